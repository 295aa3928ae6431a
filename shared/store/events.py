"""The per-task event log: appended in the same transaction as the change it records (seqs
are reserved by the task row's UPDATE; see ``writes.write`` and ``insert_events``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, cast, get_args

from sqlalchemy import Table, insert, select
from sqlalchemy.orm import Session

from shared.store import outbox
from shared.store.fenced import EventSpec
from shared.store.tables import TaskEvent, utcnow
from shared.views import TaskState

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


_INSERT_EVENTS = insert(cast(Table, TaskEvent.__table__))  # Core: no ORM bookkeeping


def insert_events(
    session: Session,
    events: Sequence[EventSpec],
    *,
    task: TaskState | None = None,
    task_id: str = "",
    tenant_id: str = "",
    last_seq: int = 0,
    subscriptions: Sequence[outbox.Subscription] = (),
) -> list[str]:
    """Insert events whose seqs the caller already reserved (the last ``len(events)`` seqs),
    and the outbox rows of the webhooks subscribed to them; returns the deliveries' ids.

    Events whose data is a function of the task (terminal events carry the Task) need ``task``.
    """
    if not events:
        return []
    if task is not None:
        task_id, tenant_id, last_seq = task.id, task.tenant_id, task.last_event_seq
    first = last_seq - len(events) + 1
    written: list[tuple[int, str, dict[str, Any]]] = []
    for offset, (type_, spec) in enumerate(events):
        if callable(spec):
            assert task is not None, "an event built from the task needs the task"
        data = spec(task) if callable(spec) and task is not None else spec
        written.append((first + offset, type_, data))  # type: ignore[arg-type]
    session.execute(
        _INSERT_EVENTS,
        [
            {"task_id": task_id, "seq": seq, "type": type_, "data": data, "created_at": utcnow()}
            for seq, type_, data in written
        ],
    )
    if not subscriptions:
        return []
    return outbox.add_deliveries(
        session, task_id=task_id, tenant_id=tenant_id, subscriptions=subscriptions, events=written
    )
