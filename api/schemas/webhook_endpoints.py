"""``/v1/webhook-endpoints``: a tenant's default webhook endpoints, with how their deliveries
fared and their circuit breaker."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from api.schemas.webhooks import DEFAULT_WEBHOOK_EVENTS
from shared.store.events import EVENT_TYPES, EventType
from shared.webhooks.endpoints import MAX_URL_LENGTH

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
