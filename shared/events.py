"""The per-task event log: appended in the same transaction as the change it records."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from shared.models import Task, TaskEvent

EVENT_TYPES = (
    "task.queued",
    "task.started",
    "step.model_response",
    "step.tool_call",
    "step.completed",
    "task.awaiting_approval",
    "task.succeeded",
    "task.failed",
    "task.cancelled",
)
TERMINAL_EVENT_TYPES = ("task.succeeded", "task.failed", "task.cancelled")


def append_event(session: Session, task_id: str, type_: str, data: dict[str, Any]) -> int:
    """Append an event and return its ``seq``.

    The UPDATE that allocates the seq locks the task row, so concurrent appends for the
    same task queue up behind each other and seqs come out 1, 2, 3 … without gaps.
    """
    assert type_ in EVENT_TYPES, type_
    seq = session.execute(
        update(Task)
        .where(Task.id == task_id)
        .values(last_event_seq=Task.last_event_seq + 1)
        .returning(Task.last_event_seq)
    ).scalar_one()
    session.add(TaskEvent(task_id=task_id, seq=seq, type=type_, data=data))
    session.flush()
    return seq


def list_events(
    session: Session, task_id: str, *, after: int = 0, limit: int = 500
) -> Sequence[TaskEvent]:
    return session.scalars(
        select(TaskEvent)
        .where(TaskEvent.task_id == task_id, TaskEvent.seq > after)
        .order_by(TaskEvent.seq)
        .limit(limit)
    ).all()
