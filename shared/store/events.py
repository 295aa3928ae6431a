"""The per-task event log: appended in the same transaction as the change it records (seqs
are reserved by the task row's UPDATE; see ``writes.write`` and ``insert_events``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.store import batch, outbox
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
    resolved: list[tuple[str, dict[str, Any]]] = []
    for type_, spec in events:
        if callable(spec):
            assert task is not None, "an event built from the task needs the task"
            resolved.append((type_, spec(task)))
        else:
            resolved.append((type_, spec))
    offsets = [(place, type_, data) for place, (type_, data) in enumerate(resolved, 1)]
    deliveries = outbox.delivery_rows(subscriptions, offsets, task_id=task_id)
    batch.insert_logged(
        session,
        task_id=task_id,
        tenant_id=tenant_id,
        first_seq=last_seq - len(events) + 1,
        events=resolved,
        deliveries=deliveries,
        now=utcnow(),
    )
    return [str(d["id"]) for d in deliveries]
