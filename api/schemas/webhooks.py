"""``/v1/tasks/{id}/webhooks`` and the tenant's signing secret: deliveries, their attempts,
and the events a webhook receives unless told otherwise."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

from shared.store.events import EventType

DEFAULT_WEBHOOK_EVENTS: tuple[EventType, ...] = ("task.succeeded", "task.failed", "task.cancelled")


class AttemptOut(BaseModel):
    number: int
    started_at: datetime
    status_code: int | None
    latency_ms: int
    error: str | None


class DeliveryOut(BaseModel):
    id: str
    webhook_id: str
    event_type: str
    event_seq: int
    url: str
    status: str
    attempts: list[AttemptOut]
    # Why the last try failed or was never made (e.g. refused by the egress policy at send
    # time, when no request went out and so no attempt was logged).
    last_error: str | None
    next_attempt_at_ms: int | None
    created_at: datetime
    delivered_at: datetime | None


class DeliveryList(BaseModel):
    items: list[DeliveryOut]
    next_cursor: str | None


class SecretOut(BaseModel):
    secret: str
    previous_valid_until: datetime | None
