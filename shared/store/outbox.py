"""The webhook outbox: delivery rows written in the same transaction as the events they carry,
one per (event, subscribed endpoint). What becomes of them is ``shared.webhooks.deliveries``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, cast

from sqlalchemy import BigInteger, Table, bindparam, insert, select
from sqlalchemy.orm import Session

from shared.ids import new_id
from shared.settings import get_settings
from shared.store.db import now_ms
from shared.store.tables import WebhookDelivery, WebhookEndpoint, utcnow
from shared.views import TaskState, document_without_links


class DeliveryStatus(StrEnum):
    """A delivery row: ``pending → sending → delivered``, back to ``pending`` to retry, or
    ``failed`` (out of attempts) or ``disabled`` (its receiver or endpoint is gone)."""

    PENDING = "pending"
    SENDING = "sending"
    DELIVERED = "delivered"
    FAILED = "failed"
    DISABLED = "disabled"


SUPERSEDED = "superseded"  # not a row status: a late sender whose claim was taken over
ENDPOINT_CACHE_SECONDS = 5.0
INSERT_DELIVERY = insert(cast(Table, WebhookDelivery.__table__)).values(
    next_attempt_ms=now_ms() + bindparam("b_first_delay_ms", type_=BigInteger)
)


@dataclass(frozen=True)
class Subscription:
    url: str
    events: frozenset[str]
    endpoint_id: str | None = None  # None: the task's own webhook


_endpoint_cache: dict[str, tuple[float, list[Subscription]]] = {}


def tenant_subscriptions(session: Session, tenant_id: str) -> list[Subscription]:
    """The tenant's enabled default endpoints (cached for a few seconds per process)."""
    cached = _endpoint_cache.get(tenant_id)
    if cached and time.monotonic() - cached[0] < ENDPOINT_CACHE_SECONDS:
        return cached[1]
    rows = session.scalars(
        select(WebhookEndpoint).where(
            WebhookEndpoint.tenant_id == tenant_id, WebhookEndpoint.enabled.is_(True)
        )
    ).all()
    subscriptions = [Subscription(r.url, frozenset(r.events), r.id) for r in rows]
    _endpoint_cache[tenant_id] = (time.monotonic(), subscriptions)
    return subscriptions


def forget_subscriptions(tenant_id: str) -> None:
    """Drop this process's cached endpoints of the tenant (one was added or disabled)."""
    _endpoint_cache.pop(tenant_id, None)


def subscriptions_for(session: Session, task: TaskState) -> list[Subscription]:
    subscriptions = list(tenant_subscriptions(session, task.tenant_id))
    if task.webhook and not task.webhook.get("disabled_reason"):
        subscriptions.append(Subscription(task.webhook["url"], frozenset(task.webhook["events"])))
    return subscriptions


def delivery_rows(
    subscriptions: Sequence[Subscription],
    events: Sequence[tuple[int, str, dict[str, Any]]],
    *,
    task_id: str,
) -> list[dict[str, Any]]:
    """One delivery per (event, subscription) that wants it: ``offset`` is the event's key in
    ``events`` (its seq, or its place in a batch), ``id`` the delivery's webhook-id. Every
    body names its task (a step event's data names its step).

    A body carries no approval link (whoever receives it could decide the call with it)
    unless the operator turned on ``RATCHET_WEBHOOK_APPROVAL_LINKS``."""
    timestamp = datetime.now(UTC).isoformat()
    return [
        {
            "id": new_id(),
            "endpoint_id": sub.endpoint_id,
            "offset": offset,
            "event_type": type_,
            "url": sub.url,
            "payload": {
                "type": type_,
                "timestamp": timestamp,
                "task_id": task_id,
                "data": _webhook_data(type_, data),
            },
        }
        for offset, type_, data in events
        for sub in subscriptions
        if type_ in sub.events
    ]


def _webhook_data(type_: str, data: dict[str, Any]) -> dict[str, Any]:
    if get_settings().webhook_approval_links:
        return data
    return document_without_links(data)


def first_delay_ms() -> int:
    """The wait before a delivery's first attempt: the schedule's first entry (normally 0)."""
    from shared.settings import get_settings

    return int(get_settings().webhook_retry_schedule[0] * 1000)


def pending_delivery(
    *,
    id: Any,
    tenant_id: Any,
    task_id: Any,
    endpoint_id: Any,
    event_seq: Any,
    event_type: Any,
    url: Any,
    payload: Any,
    created_at: Any,
) -> dict[str, Any]:
    """A new outbox row, pending its first attempt: the one description of its columns. The
    values are Python values, or SQL expressions where a statement computes them (see
    ``shared.store.backends.postgresql``); ``next_attempt_ms`` is the statement's to set."""
    return {
        "id": id,
        "tenant_id": tenant_id,
        "task_id": task_id,
        "endpoint_id": endpoint_id,
        "event_seq": event_seq,
        "event_type": event_type,
        "url": url,
        "payload": payload,
        "status": DeliveryStatus.PENDING,
        "attempts": 0,
        "attempts_base": 0,
        "created_at": created_at,
    }


def record(d: dict[str, Any], *, tenant_id: str, task_id: str, event_seq: int) -> dict[str, Any]:
    """The outbox row of a ``delivery_rows`` item whose event has ``event_seq``, for
    ``INSERT_DELIVERY`` (whose ``b_first_delay_ms`` sets the first attempt's time)."""
    row = pending_delivery(
        id=d["id"],
        tenant_id=tenant_id,
        task_id=task_id,
        endpoint_id=d["endpoint_id"],
        event_seq=event_seq,
        event_type=d["event_type"],
        url=d["url"],
        payload=d["payload"],
        created_at=utcnow(),
    )
    return row | {"b_first_delay_ms": first_delay_ms()}
