"""The fleet's limits: rate-limit buckets and concurrency limits, with their usage."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field


class LimitOut(BaseModel):
    kind: str
    name: str
    spec: dict[str, Any]
    source: Literal["runtime", "configuration"]
    updated_by: str | None = None
    updated_at: datetime | None = None


class ConcurrencyUsage(BaseModel):
    """What a tenant, an agent or a pool holds now."""

    running: int = Field(description="admitted now: running, or its message on the way")
    waiting: int = Field(0, description="in the backlog (tenants only)")
    queued: int = Field(0, description="of those waiting, how many never started (tenants only)")


class ConcurrencyView(BaseModel):
    fair_scheduling: bool
    limits: list[LimitOut]
    tenants: dict[str, ConcurrencyUsage]
    agents: dict[str, ConcurrencyUsage]
    pools: dict[str, ConcurrencyUsage]
    admitted: int = Field(description="tasks admitted fleet-wide")
    in_queue: int = Field(description="of which still a message in the broker")
