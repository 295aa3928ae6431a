"""A webhook delivery's life after its outbox row is written: claimed by a sender, each attempt
logged, retried on ``RATCHET_WEBHOOK_RETRY_SCHEDULE`` with jitter, failed or disabled (a 410
disables its endpoint), handed out again by the sweeper when due, redelivered on request.

A delivery goes ``pending → sending → delivered | failed | disabled``; ``sending`` is a claim
with an expiry, so a sender that dies mid-send leaves a row the sweeper hands out again (with
the same ``webhook-id``, which receivers use to drop duplicates). A delivery whose endpoint's
circuit is open (``shared.webhooks.circuits``) is put off instead of sent: that attempt is
logged as not sent and counts against the retry schedule like a failed one, so the schedule
still bounds how long a delivery lives.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, select, update
from sqlalchemy.orm import Session

from shared.errors import NotFound
from shared.store.db import now_ms
from shared.store.outbox import SUPERSEDED, DeliveryStatus, forget_subscriptions
from shared.store.tables import Task, WebhookAttempt, WebhookDelivery, WebhookEndpoint, utcnow
from shared.webhooks import circuits


def claim(session: Session, delivery_id: str, *, claim_ms: int) -> WebhookDelivery | None:
    """Take a due delivery for sending (or one whose sender's claim expired)."""
    due = (
        (WebhookDelivery.status == DeliveryStatus.PENDING)
        & (WebhookDelivery.next_attempt_ms <= now_ms())
    ) | (
        (WebhookDelivery.status == DeliveryStatus.SENDING)
        & (WebhookDelivery.claim_expires_ms < now_ms())
    )
    return session.scalars(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == delivery_id, due)
        .values(
            status=DeliveryStatus.SENDING,
            attempts=WebhookDelivery.attempts + 1,
            claim_expires_ms=now_ms() + claim_ms,
        )
        .returning(WebhookDelivery),
        execution_options={"populate_existing": True, "synchronize_session": False},
    ).one_or_none()


@dataclass(frozen=True)
class AttemptResult:
    started_at: datetime
    status_code: int | None
    latency_ms: int
    error: str | None


def next_delay_seconds(delivery: WebhookDelivery, schedule: Sequence[float]) -> float | None:
    """Seconds until the next try (with ±20% jitter), or None when the schedule is spent.

    ``schedule[0]`` is the wait before the first attempt (see first_delay_ms); after the
    i-th attempt the next one waits ``schedule[i]``.
    """
    made = delivery.attempts - delivery.attempts_base
    if made >= len(schedule):
        return None
    return float(schedule[made]) * random.uniform(0.8, 1.2)


def record_attempt(
    session: Session,
    delivery: WebhookDelivery,
    result: AttemptResult,
    *,
    schedule: Sequence[float],
) -> tuple[str, float | None]:
    """Log the attempt and move the delivery on; returns (new status, seconds to next try).

    Only the holder of the current claim records: a sender whose claim ran out and was taken
    over by another records nothing (status ``superseded``).
    """
    values, delay = _next_state(session, delivery, result, schedule=schedule)
    if not _write_attempt(session, delivery, result, values):
        return SUPERSEDED, None
    code = result.status_code
    if delivery.endpoint_id and code != 410:  # a 410 has disabled it already
        succeeded = code is not None and 200 <= code < 300
        circuits.record(session, delivery.endpoint_id, succeeded=succeeded)
    return str(values["status"]), delay


def defer(
    session: Session,
    delivery: WebhookDelivery,
    *,
    until_ms: int,
    schedule: Sequence[float],
) -> tuple[str, float | None]:
    """Put off a claimed delivery whose endpoint's circuit is open, without a request: the
    attempt is logged as not sent and the next one waits the schedule's delay, and at least
    until ``until_ms`` (plus up to a tenth of the wait, so the deliveries held back do not
    all come due at once). Returns (new status, seconds to the next try), as record_attempt.
    """
    clock = int(session.scalar(select(now_ms())) or 0)
    wait_ms = max(until_ms - clock, 0)
    not_sent = AttemptResult(
        started_at=utcnow(),
        status_code=None,
        latency_ms=0,
        error="not sent: the endpoint's circuit is open after failed attempts in a row",
    )
    values, delay = _next_state(session, delivery, not_sent, schedule=schedule)
    if delay is not None and delay * 1000 < wait_ms:
        delay = (wait_ms + random.uniform(0, wait_ms / 10)) / 1000
        values["next_attempt_ms"] = clock + int(delay * 1000)
    if not _write_attempt(session, delivery, not_sent, values):
        return SUPERSEDED, None
    return str(values["status"]), delay


def _write_attempt(
    session: Session, delivery: WebhookDelivery, result: AttemptResult, values: dict[str, Any]
) -> bool:
    """Move the claimed delivery to ``values`` and log the attempt, if the claim is still
    ours; whether it was."""
    done = session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == delivery.id, WebhookDelivery.status == DeliveryStatus.SENDING)
        .where(WebhookDelivery.attempts == delivery.attempts)  # still our claim
        .values(values)
        .execution_options(synchronize_session=False)
    )
    if done.rowcount != 1:  # type: ignore[attr-defined]
        return False
    session.add(
        WebhookAttempt(
            delivery_id=delivery.id,
            number=delivery.attempts,
            started_at=result.started_at,
            status_code=result.status_code,
            latency_ms=result.latency_ms,
            error=result.error,
        )
    )
    return True


def _next_state(
    session: Session,
    delivery: WebhookDelivery,
    result: AttemptResult,
    *,
    schedule: Sequence[float],
) -> tuple[dict[str, Any], float | None]:
    """The row's new values after this attempt, and the seconds to the next one (if any)."""
    code = result.status_code
    values: dict[str, Any] = {
        "last_status_code": code,
        "last_error": result.error,
        "claim_expires_ms": None,
    }
    if code is not None and 200 <= code < 300:
        return values | {
            "status": DeliveryStatus.DELIVERED,
            "delivered_at": utcnow(),
            "next_attempt_ms": None,
        }, None
    if code == 410:
        disable_target(session, delivery, reason="the receiver answered 410 Gone")
        return values | {"status": DeliveryStatus.DISABLED, "next_attempt_ms": None}, None
    delay = next_delay_seconds(delivery, schedule)
    if delay is None:
        return values | {"status": DeliveryStatus.FAILED, "next_attempt_ms": None}, None
    return values | {
        "status": DeliveryStatus.PENDING,
        "next_attempt_ms": now_ms() + int(delay * 1000),
    }, delay


def routes(session: Session, delivery_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
    """Each delivery's tenant and URL, for the sender to queue it fairly (ids not found are
    left out: a delivery whose transaction rolled back)."""
    if not delivery_ids:
        return {}
    rows = session.execute(
        select(WebhookDelivery.id, WebhookDelivery.tenant_id, WebhookDelivery.url).where(
            WebhookDelivery.id.in_(list(delivery_ids))
        )
    )
    return {row[0]: (row[1], row[2]) for row in rows}


def target_disabled(session: Session, delivery: WebhookDelivery) -> str | None:
    """Why the receiver of this delivery was disabled (by a 410), or None.

    Checked at send time: another process may have disabled it after this row was queued.
    """
    if delivery.endpoint_id:
        endpoint = session.get(WebhookEndpoint, delivery.endpoint_id)
        if endpoint is None:
            return "the endpoint was removed"
        return None if endpoint.enabled else endpoint.disabled_reason or "the endpoint is disabled"
    webhook = session.scalar(select(Task.webhook).where(Task.id == delivery.task_id))
    if webhook and webhook.get("url") == delivery.url:
        reason = webhook.get("disabled_reason")
        return str(reason) if reason else None
    return None


def mark_disabled(session: Session, delivery: WebhookDelivery, reason: str) -> None:
    session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == delivery.id)
        .values(
            status=DeliveryStatus.DISABLED,
            last_error=reason,
            next_attempt_ms=None,
            claim_expires_ms=None,
        )
        .execution_options(synchronize_session=False)
    )


def fail_permanently(session: Session, delivery: WebhookDelivery, error: str) -> None:
    session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == delivery.id)
        .values(
            status=DeliveryStatus.FAILED,
            last_error=error,
            next_attempt_ms=None,
            claim_expires_ms=None,
        )
        .execution_options(synchronize_session=False)
    )


def disable_target(session: Session, delivery: WebhookDelivery, *, reason: str) -> None:
    """Stop sending to this receiver: its endpoint, or this task's webhook URL."""
    if delivery.endpoint_id:
        session.execute(
            update(WebhookEndpoint)
            .where(WebhookEndpoint.id == delivery.endpoint_id)
            .values(enabled=False, disabled_reason=reason)
            .execution_options(synchronize_session=False)
        )
        forget_subscriptions(delivery.tenant_id)
        same_target = WebhookDelivery.endpoint_id == delivery.endpoint_id
    else:
        task = session.get(Task, delivery.task_id)
        if task is not None and task.webhook:  # later events of the task skip this URL
            task.webhook = {**task.webhook, "disabled_reason": reason}
        same_target = (WebhookDelivery.task_id == delivery.task_id) & (
            WebhookDelivery.url == delivery.url
        )
    session.execute(
        update(WebhookDelivery)
        .where(same_target, WebhookDelivery.status == DeliveryStatus.PENDING)
        .values(status=DeliveryStatus.DISABLED, last_error=reason, next_attempt_ms=None)
        .execution_options(synchronize_session=False)
    )


def _overdue(
    clock: ColumnElement[int], *, grace_ms: int, sent_before_ms: int | None
) -> ColumnElement[bool]:
    """Due for a send and no message for it in sight: pending and due, or its sender's claim
    ran out, and no message sent for it within the grace. ``next_attempt_ms`` is when it
    became due or when the sweeper last sent it a message; one due since ``sent_before_ms``
    (when the oldest message still waiting in the queue was sent, see the sweeper) is only
    behind a backlog."""
    waiting = (WebhookDelivery.status == DeliveryStatus.PENDING) | (
        (WebhookDelivery.status == DeliveryStatus.SENDING)
        & (WebhookDelivery.claim_expires_ms < clock)
    )
    overdue = waiting & (WebhookDelivery.next_attempt_ms <= clock - grace_ms)
    if sent_before_ms is not None:
        overdue &= WebhookDelivery.next_attempt_ms < sent_before_ms
    return overdue


def due(
    session: Session, *, grace_ms: int, sent_before_ms: int | None = None, limit: int = 500
) -> list[str]:
    """Deliveries whose message seems lost: see ``_overdue``."""
    rows = session.scalars(
        select(WebhookDelivery.id)
        .where(_overdue(now_ms(), grace_ms=grace_ms, sent_before_ms=sent_before_ms))
        .order_by(WebhookDelivery.next_attempt_ms)
        .limit(limit)
    ).all()
    return list(rows)


def mark_redispatched(
    session: Session, delivery_ids: Sequence[str], *, grace_ms: int, sent_before_ms: int | None
) -> list[str]:
    """Claim the overdue ones among ``delivery_ids`` for a new message, in one statement (their
    ``next_attempt_ms`` moves to now, so the next sweep leaves them alone for the grace);
    returns their ids, for the caller to send. A sender's claim is left as it is."""
    if not delivery_ids:
        return []
    rows = session.scalars(
        update(WebhookDelivery)
        .where(
            WebhookDelivery.id.in_(delivery_ids),
            _overdue(now_ms(), grace_ms=grace_ms, sent_before_ms=sent_before_ms),
        )
        .values(next_attempt_ms=now_ms())
        .returning(WebhookDelivery.id)
        .execution_options(synchronize_session=False)
    ).all()
    return list(rows)


def redeliver(session: Session, tenant_id: str, delivery_id: str) -> WebhookDelivery:
    """Send again now, with a fresh retry schedule; the attempt log keeps growing."""
    delivery = session.scalar(
        select(WebhookDelivery).where(
            WebhookDelivery.id == delivery_id, WebhookDelivery.tenant_id == tenant_id
        )
    )
    if delivery is None:
        raise NotFound(f"no webhook delivery {delivery_id}")
    session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == delivery_id, WebhookDelivery.status != DeliveryStatus.SENDING)
        .values(
            status=DeliveryStatus.PENDING,
            attempts_base=WebhookDelivery.attempts,
            next_attempt_ms=now_ms(),
            last_error=None,
        )
        .execution_options(synchronize_session=False)
    )
    session.refresh(delivery)
    return delivery


def attempts_of(session: Session, delivery_ids: Sequence[str]) -> dict[str, list[WebhookAttempt]]:
    """Each delivery's attempts, in order."""
    attempts: dict[str, list[WebhookAttempt]] = {d: [] for d in delivery_ids}
    if delivery_ids:
        for attempt in session.scalars(
            select(WebhookAttempt)
            .where(WebhookAttempt.delivery_id.in_(list(delivery_ids)))
            .order_by(WebhookAttempt.delivery_id, WebhookAttempt.number)
        ):
            attempts[attempt.delivery_id].append(attempt)
    return attempts


def list_for_task(
    session: Session, task_id: str, *, after: str | None, limit: int
) -> tuple[list[WebhookDelivery], dict[str, list[WebhookAttempt]], str | None]:
    query = select(WebhookDelivery).where(WebhookDelivery.task_id == task_id)
    if after:
        query = query.where(WebhookDelivery.id > after)
    rows = list(session.scalars(query.order_by(WebhookDelivery.id).limit(limit + 1)).all())
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, attempts_of(session, [r.id for r in rows]), rows[-1].id if more else None


def failing(session: Session, tenant_id: str | None, *, limit: int = 50) -> list[WebhookDelivery]:
    """The newest deliveries that failed for good, or were dropped because their endpoint
    was disabled (every tenant's when ``tenant_id`` is None), from ``(status, …)``."""
    query = select(WebhookDelivery).where(
        WebhookDelivery.status.in_((DeliveryStatus.FAILED, DeliveryStatus.DISABLED))
    )
    if tenant_id is not None:
        query = query.where(WebhookDelivery.tenant_id == tenant_id)
    return list(session.scalars(query.order_by(WebhookDelivery.id.desc()).limit(limit)))
