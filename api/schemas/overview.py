"""``/v1/overview``: tasks, latencies, usage and errors over the last hour or day."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class Percentiles(BaseModel):
    p50: float | None
    p95: float | None
    p99: float | None
    count: int = Field(description="how many values the percentiles were taken over")


class Latency(BaseModel):
    task_duration_ms: Percentiles = Field(description="start to finish, newest finished tasks")
    model_latency_ms: Percentiles = Field(description="model calls of the newest tasks' steps")


class Bucket(BaseModel):
    start: datetime
    submitted: int
    succeeded: int
    failed: int
    cancelled: int


class UsageRow(BaseModel):
    model: str | None = None
    agent: str | None = None
    tenant: str | None = None
    tasks: int
    input_tokens: int
    output_tokens: int
    cost_usd: float


class ErrorCount(BaseModel):
    type: str
    count: int


class Overview(BaseModel):
    window: str
    since: datetime
    states: dict[str, int] = Field(
        description="queued, running and awaiting_approval now; the terminal states: tasks "
        "that finished in the window"
    )
    series: list[Bucket] = Field(description="per minute (1h) or per hour (24h)")
    latency: Latency
    usage: dict[str, list[UsageRow]] = Field(description="by model, agent and tenant")
    errors: list[ErrorCount]
    webhook_failures: int
