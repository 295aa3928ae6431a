"""The public shape of a task: the JSON that the API returns, events carry and webhooks send."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from shared.models import Task


class Usage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0


class TaskView(BaseModel):
    id: str
    status: str
    agent: str
    model: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    steps: int
    attempt: int
    usage: Usage
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    pending_approval: dict[str, Any] | None
    metadata: dict[str, Any]


def aware(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every time Ratchet stores is UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


def task_view(task: Task) -> TaskView:
    created_at = aware(task.created_at)
    assert created_at is not None
    return TaskView(
        id=task.id,
        status=task.status,
        agent=task.agent,
        model=task.model,
        created_at=created_at,
        started_at=aware(task.started_at),
        finished_at=aware(task.finished_at),
        steps=task.steps,
        attempt=task.attempt,
        usage=Usage(
            input_tokens=task.input_tokens,
            output_tokens=task.output_tokens,
            cost_usd=round(task.cost_usd, 8),
        ),
        result=task.result,
        error=task.error,
        pending_approval=task.pending_approval,
        metadata=task.meta,
    )


def task_document(task: Task) -> dict[str, Any]:
    return task_view(task).model_dump(mode="json")
