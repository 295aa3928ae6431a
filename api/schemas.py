"""Request and response bodies. Pydantic classes, never ORM models."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, HttpUrl

from shared.events import EVENT_TYPES
from shared.views import TaskView, Usage

EventType = Literal[
    "task.queued",
    "task.started",
    "step.model_response",
    "step.tool_call",
    "step.completed",
    "task.awaiting_approval",
    "task.succeeded",
    "task.failed",
    "task.cancelled",
]
assert set(EVENT_TYPES) == set(EventType.__args__)  # type: ignore[attr-defined]

DEFAULT_WEBHOOK_EVENTS: tuple[EventType, ...] = ("task.succeeded", "task.failed", "task.cancelled")
ShortText = Annotated[str, Field(min_length=1, max_length=200)]
MetadataValue = str | int | float | bool | None


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(max_length=200_000)]


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(None, gt=0)
    max_cost_usd: float | None = Field(None, gt=0)


class WebhookSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: HttpUrl
    events: list[EventType] = Field(
        default_factory=lambda: list(DEFAULT_WEBHOOK_EVENTS), max_length=9
    )


class TaskCreate(BaseModel):
    """What a client submits. Only ``input`` is required."""

    model_config = ConfigDict(extra="forbid")

    agent: ShortText = "default"
    input: (
        Annotated[str, Field(min_length=1, max_length=200_000)]
        | Annotated[list[InputMessage], Field(min_length=1, max_length=500)]
    )
    model: ShortText | None = None
    model_options: dict[str, Any] = Field(default_factory=dict)
    instructions: Annotated[str, Field(max_length=50_000)] | None = None
    tools: Annotated[list[ShortText], Field(max_length=100)] | None = None
    max_steps: int | None = Field(None, ge=1)
    budget: Budget | None = None
    webhook: WebhookSpec | None = None
    metadata: Annotated[
        dict[Annotated[str, Field(max_length=100)], MetadataValue], Field(max_length=50)
    ] = Field(default_factory=dict)


class TaskList(BaseModel):
    items: list[TaskView]
    next_cursor: str | None


class ToolCallOut(BaseModel):
    id: str
    provider_call_id: str
    name: str
    arguments: dict[str, Any]
    status: str
    result: Any
    error: str | None
    idempotency_key: str
    runs: int
    started_at: datetime
    finished_at: datetime | None


class StepOut(BaseModel):
    number: int
    status: str
    model: dict[str, Any]
    usage: Usage
    model_latency_ms: int
    started_at: datetime
    model_completed_at: datetime
    completed_at: datetime | None
    tool_calls: list[ToolCallOut]


class StepList(BaseModel):
    items: list[StepOut]
    next_cursor: str | None
    waiting: dict[str, Any] | None = Field(
        None, description="why the next step has not run yet (rate_limited, retry_backoff, …)"
    )


class ToolOut(BaseModel):
    name: str
    description: str
    parameters: dict[str, Any]
    idempotent: bool
    requires_approval: bool
    timeout: float | None


class AgentOut(BaseModel):
    name: str
    description: str
    model: str | None
    max_steps: int | None
    tools: list[ToolOut]


class AgentList(BaseModel):
    items: list[AgentOut]
    next_cursor: str | None
