"""What a tenant (over the API or the dashboard) or an operator (the CLI) can do about its
webhooks: send a delivery again, and add, describe, change, disable and remove its default
endpoints. Each is one transaction; an endpoint is described one way for every front door."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from shared.actions.effects import Effects
from shared.store import tenants
from shared.store.tables import WebhookAttempt, WebhookDelivery, WebhookEndpoint, utcnow
from shared.views import aware
from shared.webhooks import circuits, endpoints
from shared.webhooks import deliveries as webhook_deliveries
from shared.webhooks.circuits import Circuit
from shared.webhooks.endpoints import DeliveryCounts

RATES_WINDOW = timedelta(hours=24)  # an endpoint's deliveries are counted over this


@dataclass(frozen=True)
class Endpoint:
    """An endpoint as every front door shows it: its settings, its last day's deliveries by
    outcome, and its circuit breaker."""

    id: str
    tenant_id: str
    url: str
    events: list[str]
    enabled: bool
    disabled_reason: str | None
    created_at: datetime | None
    deliveries: DeliveryCounts
    circuit: Circuit


def describe(session: Session, rows: Sequence[WebhookEndpoint]) -> list[Endpoint]:
    """The rows as shown, in the caller's transaction (their success rates read a window)."""
    rates = endpoints.success_rates(session, [r.id for r in rows], utcnow() - RATES_WINDOW)
    return [
        Endpoint(
            id=row.id,
            tenant_id=row.tenant_id,
            url=row.url,
            events=list(row.events),
            enabled=row.enabled,
            disabled_reason=row.disabled_reason,
            created_at=aware(row.created_at),
            deliveries=rates[row.id],
            circuit=circuits.circuit_of(row),
        )
        for row in rows
    ]


def add_endpoint(session: Session, tenant_id: str, *, url: str, events: Sequence[str]) -> Endpoint:
    """A new endpoint of the tenant's (InvalidRequest for a URL the egress policy refuses or
    unknown events; Conflict past the tenant's most endpoints)."""
    with session.begin():
        [added] = describe(session, [endpoints.create(session, tenant_id, url=url, events=events)])
    return added


def change_endpoint(
    session: Session,
    tenant_id: str,
    endpoint_id: str,
    *,
    url: str | None = None,
    events: Sequence[str] | None = None,
    enabled: bool | None = None,
    by_key: str,
) -> Endpoint:
    """Change the URL or the events, and disable (the reason naming the key ``by_key``) or
    re-enable it; what is None stays as it is."""
    with session.begin():
        row = endpoints.update(session, tenant_id, endpoint_id, url=url, events=events)
        if enabled is not None:
            reason = None if enabled else _disabled_by(session, tenant_id, by_key)
            row = endpoints.set_enabled(session, tenant_id, endpoint_id, enabled, reason)
        [changed] = describe(session, [row])
    return changed


def _disabled_by(session: Session, tenant_id: str, key_id: str) -> str:
    key = tenants.get_key(session, tenant_id, key_id)
    return f"disabled by {key.name or key.id}"


def enable_endpoint(
    session: Session, tenant_id: str, endpoint_id: str, enabled: bool, *, reason: str
) -> None:
    """Enable the endpoint, or disable it for ``reason`` (one disabled already keeps its
    first reason)."""
    with session.begin():
        endpoints.set_enabled(session, tenant_id, endpoint_id, enabled, reason=reason)


def remove_endpoint(session: Session, tenant_id: str, endpoint_id: str) -> None:
    """Remove the endpoint; its deliveries still queued are not sent."""
    with session.begin():
        endpoints.delete(session, tenant_id, endpoint_id)


@dataclass(frozen=True)
class Redelivered:
    """A delivery sent again: as it stands, with its attempts so far."""

    delivery: WebhookDelivery
    attempts: list[WebhookAttempt]
    effects: Effects


def redeliver(session: Session, tenant_id: str, delivery_id: str) -> Redelivered:
    """Send the tenant's delivery again now, with a fresh retry schedule (NotFound for
    another tenant's)."""
    with session.begin():
        delivery = webhook_deliveries.redeliver(session, tenant_id, delivery_id)
        attempts = webhook_deliveries.attempts_of(session, [delivery_id])[delivery_id]
    return Redelivered(delivery, attempts, Effects(deliveries=(delivery_id,)))
