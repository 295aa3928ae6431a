"""The per-task event log: appended in the same transaction as the change it records (seqs
are reserved by the task row's UPDATE; see task_store.write and task_store.insert_events)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.models import TaskEvent

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
EVENT_TYPES: tuple[str, ...] = get_args(EventType)  # the one list of them
TERMINAL_EVENT_TYPES = ("task.succeeded", "task.failed", "task.cancelled")


def list_events(
    session: Session, task_id: str, *, after: int = 0, limit: int = 500
) -> Sequence[TaskEvent]:
    return session.scalars(
        select(TaskEvent)
        .where(TaskEvent.task_id == task_id, TaskEvent.seq > after)
        .order_by(TaskEvent.seq)
        .limit(limit)
    ).all()


def last_event(session: Session, task_id: str) -> TaskEvent | None:
    """The newest event of the task: terminal only while the task's current state is."""
    return session.scalars(
        select(TaskEvent)
        .where(TaskEvent.task_id == task_id)
        .order_by(TaskEvent.seq.desc())
        .limit(1)
    ).first()
