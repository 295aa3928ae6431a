"""``/v1/webhook-endpoints``: a tenant admin lists, adds, changes, disables, re-enables and
removes its tenant's default webhook endpoints, each shown with how its last day's deliveries
fared. Another tenant's endpoint is not found, whatever the key's scopes.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from api import params
from api.deps import Admin, SessionDep
from api.params import cursor_after
from api.problems import responses
from api.schemas import DEFAULT_WEBHOOK_EVENTS
from shared.store import tenants
from shared.store.events import EVENT_TYPES, EventType
from shared.store.tables import WebhookEndpoint, utcnow
from shared.store.tenants import Principal
from shared.views import aware
from shared.webhooks import circuits, endpoints
from shared.webhooks.endpoints import MAX_URL_LENGTH

router = APIRouter(prefix="/v1/webhook-endpoints", tags=["webhook-endpoints"])
RATES_WINDOW = timedelta(hours=24)
NOT_FOUND = "no such endpoint (another tenant's is not found either)"
URL_DESCRIPTION = "https, and a public address unless allow-listed (RATCHET_WEBHOOK_ALLOWED_HOSTS)"
EVENTS_DESCRIPTION = "the event types it receives of every task of the tenant"


class EndpointCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        min_length=1,
        max_length=MAX_URL_LENGTH,
        description=URL_DESCRIPTION,
        examples=["https://example.com/hooks/ratchet"],
    )
    events: list[EventType] = Field(
        default_factory=lambda: list(DEFAULT_WEBHOOK_EVENTS),
        min_length=1,
        max_length=len(EVENT_TYPES),
        description=f"{EVENTS_DESCRIPTION} (default: the terminal ones)",
    )


class EndpointPatch(BaseModel):
    """What to change; a field left out stays as it is."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(
        None, min_length=1, max_length=MAX_URL_LENGTH, description=URL_DESCRIPTION
    )
    events: list[EventType] | None = Field(
        None, min_length=1, max_length=len(EVENT_TYPES), description=EVENTS_DESCRIPTION
    )
    enabled: bool | None = Field(
        None,
        description="false stops sending to it; true sends to it again and clears "
        "``disabled_reason`` (deliveries it missed while disabled are not sent)",
    )


class DeliveryCounts(BaseModel):
    """The endpoint's deliveries of the last 24 hours, by outcome."""

    succeeded: int
    failed: int = Field(description="failed for good, or not sent because it was disabled")
    pending: int = Field(description="due or being sent, retries included")


class CircuitOut(BaseModel):
    """The endpoint's circuit breaker: after RATCHET_WEBHOOK_BREAKER_FAILURES failed attempts
    in a row it opens, and its deliveries wait (``pending``) without a request until one probe
    succeeds."""

    state: Literal["closed", "open", "half_open"] = Field(
        description="closed: sent to; open: held back until ``until``; half_open: a probe is out"
    )
    consecutive_failures: int = Field(description="failed attempts in a row")
    until: datetime | None = Field(
        description="open: when the probe may go; half_open: when a lost probe is given up on"
    )


class EndpointOut(BaseModel):
    id: str
    url: str
    events: list[str]
    enabled: bool
    disabled_reason: str | None = Field(
        description="why it was disabled: by whom, or the receiver's 410"
    )
    created_at: datetime
    deliveries: DeliveryCounts
    circuit: CircuitOut


class EndpointList(BaseModel):
    items: list[EndpointOut]
    next_cursor: str | None


def _fields(row: WebhookEndpoint) -> dict[str, Any]:
    return {
        "id": row.id,
        "url": row.url,
        "events": list(row.events),
        "enabled": row.enabled,
        "disabled_reason": row.disabled_reason,
        "created_at": aware(row.created_at),
        "circuit": CircuitOut.model_validate(circuits.circuit_of(row), from_attributes=True),
    }


def _out(session: Session, rows: list[WebhookEndpoint]) -> list[EndpointOut]:
    """The rows as the API shows them, each with its last 24 hours' deliveries."""
    rates = endpoints.success_rates(session, [r.id for r in rows], utcnow() - RATES_WINDOW)
    return [
        EndpointOut(
            **_fields(row),
            deliveries=DeliveryCounts.model_validate(rates[row.id], from_attributes=True),
        )
        for row in rows
    ]


def _disabled_by(session: Session, principal: Principal) -> str:
    key = tenants.get_key(session, principal.tenant_id, principal.key_id)
    return f"disabled by {key.name or key.id}"


@router.get("", response_model=EndpointList, summary="List the tenant's webhook endpoints")
def list_endpoints(
    principal: Admin,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=200, description="at most this many")] = 50,
    cursor: Annotated[
        str | None, Query(max_length=200, description="``next_cursor`` of the page before")
    ] = None,
) -> EndpointList:
    """The tenant's endpoints, newest first, disabled ones included, each with its last 24
    hours' deliveries."""
    after = cursor_after(cursor)
    with session.begin():
        rows = endpoints.list_for(session, principal.tenant_id, after=after, limit=limit + 1)
        items = _out(session, rows[:limit])
    more = len(rows) > limit
    return EndpointList(
        items=items, next_cursor=params.encode_cursor(items[-1].id) if more else None
    )


@router.post(
    "",
    status_code=201,
    response_model=EndpointOut,
    summary="Add a webhook endpoint",
    responses=responses(
        {
            409: "the tenant has its most endpoints (RATCHET_MAX_WEBHOOK_ENDPOINTS_PER_TENANT)",
            422: "the body is invalid, or the egress policy refuses the URL",
        }
    ),
)
def create_endpoint(body: EndpointCreate, principal: Admin, session: SessionDep) -> EndpointOut:
    """A new endpoint: from now on it receives the listed events of every task of the tenant
    (running processes see it within 5 s). A tenant has at most
    RATCHET_MAX_WEBHOOK_ENDPOINTS_PER_TENANT endpoints, disabled ones included."""
    with session.begin():
        row = endpoints.create(session, principal.tenant_id, url=body.url, events=body.events)
        [created] = _out(session, [row])
    return created


@router.get(
    "/{endpoint_id}",
    response_model=EndpointOut,
    summary="Get a webhook endpoint",
    responses=responses({404: NOT_FOUND}),
)
def get_endpoint(endpoint_id: str, principal: Admin, session: SessionDep) -> EndpointOut:
    """The endpoint, with its last 24 hours' deliveries."""
    with session.begin():
        [found] = _out(session, [endpoints.get(session, principal.tenant_id, endpoint_id)])
    return found


@router.patch(
    "/{endpoint_id}",
    response_model=EndpointOut,
    summary="Change, disable or re-enable a webhook endpoint",
    responses=responses(
        {404: NOT_FOUND, 422: "the body is invalid, or the egress policy refuses the URL"}
    ),
)
def update_endpoint(
    endpoint_id: str, body: EndpointPatch, principal: Admin, session: SessionDep
) -> EndpointOut:
    """Change the URL or the events, or disable (``"enabled": false``, its reason naming the
    caller's key) or re-enable it. Disabling one already disabled keeps the first reason."""
    tenant_id = principal.tenant_id
    with session.begin():
        row = endpoints.update(session, tenant_id, endpoint_id, url=body.url, events=body.events)
        if body.enabled is not None:
            reason = None if body.enabled else _disabled_by(session, principal)
            row = endpoints.set_enabled(session, tenant_id, endpoint_id, body.enabled, reason)
        [updated] = _out(session, [row])
    return updated


@router.delete(
    "/{endpoint_id}",
    status_code=204,
    response_class=Response,
    summary="Remove a webhook endpoint",
    responses=responses({404: NOT_FOUND}),
)
def delete_endpoint(endpoint_id: str, principal: Admin, session: SessionDep) -> Response:
    """Remove the endpoint; its deliveries still queued are not sent."""
    with session.begin():
        endpoints.delete(session, principal.tenant_id, endpoint_id)
    return Response(status_code=204)
