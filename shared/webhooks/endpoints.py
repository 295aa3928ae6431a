"""A tenant's default webhook endpoints: each receives the events it lists of every task of the
tenant. Added, listed, changed, disabled and re-enabled, removed; and how their deliveries
have fared.

Every change drops this process's cached subscriptions of the tenant; other processes see it
within ``shared.store.outbox.ENDPOINT_CACHE_SECONDS``. A change reaches only events written
after it: deliveries already in the outbox are checked against their endpoint when they are
sent (``deliveries.target_disabled``), so one of a disabled or removed endpoint goes nowhere.

A tenant has at most ``RATCHET_MAX_WEBHOOK_ENDPOINTS_PER_TENANT`` endpoints (each one is sent
every event it lists of every task: their number multiplies the tenant's sending).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from shared.errors import Conflict, EgressDenied, InvalidRequest, NotFound
from shared.ids import new_id
from shared.settings import get_settings
from shared.store.events import EVENT_TYPES, TERMINAL_EVENT_TYPES
from shared.store.outbox import DeliveryStatus, forget_subscriptions
from shared.store.tables import Tenant, WebhookDelivery, WebhookEndpoint
from shared.webhooks import circuits, egress

DEFAULT_EVENTS = TERMINAL_EVENT_TYPES
MAX_URL_LENGTH = 2048  # the column's
# How each delivery status counts in success_rates: ``disabled`` was never sent and never will
# be (its receiver answered 410, or the endpoint was disabled or removed before it went out).
OUTCOMES = {
    DeliveryStatus.DELIVERED: "succeeded",
    DeliveryStatus.FAILED: "failed",
    DeliveryStatus.DISABLED: "failed",
    DeliveryStatus.PENDING: "pending",
    DeliveryStatus.SENDING: "pending",
}


@dataclass(frozen=True)
class DeliveryCounts:
    """An endpoint's deliveries over a window, by outcome."""

    succeeded: int = 0
    failed: int = 0
    pending: int = 0


def checked_url(url: str) -> str:
    """``url`` if the egress policy lets webhooks reach it (https to a public address, or an
    allow-listed host), else InvalidRequest naming ``url``. It resolves the host: call it
    before the transaction's first statement, not while holding a connection."""
    if len(url) > MAX_URL_LENGTH:
        raise InvalidRequest("url", f"must be at most {MAX_URL_LENGTH} characters")
    allowed = get_settings().webhook_allowed_hosts
    try:
        egress.check_url(url, allowed_hosts=allowed, https_only=True)
    except EgressDenied as exc:
        raise InvalidRequest("url", str(exc)) from exc
    return url


def checked_events(events: Sequence[str]) -> list[str]:
    """The event types sorted and deduplicated; InvalidRequest naming ``events`` for an unknown
    one, or for none at all."""
    unknown = sorted(set(events) - set(EVENT_TYPES))
    if unknown:
        raise InvalidRequest("events", f"unknown event type(s) {', '.join(unknown)}")
    if not events:
        raise InvalidRequest("events", "name at least one event type")
    return sorted(set(events))


def create(
    session: Session, tenant_id: str, *, url: str, events: Sequence[str] = DEFAULT_EVENTS
) -> WebhookEndpoint:
    """A new, enabled endpoint of the tenant; the URL and the events are checked first.

    Conflict when the tenant has its most endpoints already; two creates at once cannot both
    take the last place (the tenant's row is locked while counting, on PostgreSQL; SQLite
    runs one writer at a time)."""
    endpoint = WebhookEndpoint(
        id=new_id(), tenant_id=tenant_id, url=checked_url(url), events=checked_events(events)
    )
    _check_room(session, tenant_id)
    session.add(endpoint)
    session.flush()
    forget_subscriptions(tenant_id)
    return endpoint


def _check_room(session: Session, tenant_id: str) -> None:
    """Conflict unless the tenant may add one more endpoint."""
    limit = get_settings().max_webhook_endpoints_per_tenant
    session.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
    held = session.scalar(
        select(func.count())
        .select_from(WebhookEndpoint)
        .where(WebhookEndpoint.tenant_id == tenant_id)
    )
    if (held or 0) >= limit:
        raise Conflict(
            f"the tenant has {held} webhook endpoints, the most it may have "
            f"(RATCHET_MAX_WEBHOOK_ENDPOINTS_PER_TENANT={limit}): remove one first"
        )


def list_for(
    session: Session, tenant_id: str | None, *, after: str | None = None, limit: int = 100
) -> list[WebhookEndpoint]:
    """The tenant's endpoints, newest first (ids are time-ordered), disabled ones included;
    every tenant's when ``tenant_id`` is None (the operator's view)."""
    query = select(WebhookEndpoint)
    if tenant_id is not None:
        query = query.where(WebhookEndpoint.tenant_id == tenant_id)
    if after is not None:
        query = query.where(WebhookEndpoint.id < after)
    return list(session.scalars(query.order_by(WebhookEndpoint.id.desc()).limit(limit)))


def get(session: Session, tenant_id: str, endpoint_id: str) -> WebhookEndpoint:
    """The tenant's endpoint; another tenant's is NotFound, like a missing one."""
    endpoint = session.scalar(
        select(WebhookEndpoint).where(
            WebhookEndpoint.id == endpoint_id, WebhookEndpoint.tenant_id == tenant_id
        )
    )
    if endpoint is None:
        raise NotFound(f"no webhook endpoint {endpoint_id}")
    return endpoint


def update(
    session: Session,
    tenant_id: str,
    endpoint_id: str,
    *,
    url: str | None = None,
    events: Sequence[str] | None = None,
) -> WebhookEndpoint:
    """Point the endpoint at another URL and/or change its events (None: leave as it is);
    both are checked before anything is written."""
    new_url = None if url is None else checked_url(url)
    new_events = None if events is None else checked_events(events)
    endpoint = get(session, tenant_id, endpoint_id)
    if new_url is None and new_events is None:
        return endpoint
    if new_url is not None and new_url != endpoint.url:
        endpoint.url = new_url
        circuits.reset(endpoint)  # another receiver: its predecessor's failures are not its
    if new_events is not None:
        endpoint.events = new_events
    session.flush()
    forget_subscriptions(tenant_id)
    return endpoint


def set_enabled(
    session: Session, tenant_id: str, endpoint_id: str, enabled: bool, reason: str | None = None
) -> WebhookEndpoint:
    """Enable the endpoint (clearing why it was disabled) or disable it for ``reason``.

    Disabling one already disabled keeps the first reason (say, the receiver's 410): the
    endpoint was stopped for that, not for this."""
    endpoint = get(session, tenant_id, endpoint_id)
    if endpoint.enabled != enabled:
        endpoint.enabled = enabled
        endpoint.disabled_reason = None if enabled else reason or "disabled"
        if enabled:
            circuits.reset(endpoint)
        session.flush()
        forget_subscriptions(tenant_id)
    return endpoint


def delete(session: Session, tenant_id: str, endpoint_id: str) -> None:
    """Remove the endpoint. Its deliveries stay in the log; those still queued are not sent."""
    session.delete(get(session, tenant_id, endpoint_id))
    session.flush()
    forget_subscriptions(tenant_id)


def success_rates(
    session: Session, endpoint_ids: Sequence[str], since: datetime
) -> dict[str, DeliveryCounts]:
    """Each endpoint's deliveries written since ``since``, by outcome (see ``OUTCOMES``);
    every id asked for is in the answer, with zeros if it had none."""
    counts = {
        endpoint_id: {"succeeded": 0, "failed": 0, "pending": 0} for endpoint_id in endpoint_ids
    }
    if not counts:
        return {}
    rows = session.execute(
        select(WebhookDelivery.endpoint_id, WebhookDelivery.status, func.count())
        .where(
            WebhookDelivery.endpoint_id.in_(list(counts)),
            WebhookDelivery.created_at >= since,
        )
        .group_by(WebhookDelivery.endpoint_id, WebhookDelivery.status)
    )
    for endpoint_id, status, count in rows:
        outcome = OUTCOMES.get(status)
        if endpoint_id is not None and outcome is not None:
            counts[endpoint_id][outcome] += count
    return {endpoint_id: DeliveryCounts(**by) for endpoint_id, by in counts.items()}
