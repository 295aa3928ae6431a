"""The per-task event log: appended in the same transaction as the change it records (seqs
are reserved by the task row's UPDATE; see ``writes.write`` and ``insert_events``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal, get_args

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.store import batch, ledger, outbox
from shared.store.fenced import EventSpec, names_call, names_step, stored_form
from shared.store.tables import Step, TaskEvent, ToolCall, utcnow
from shared.views import TaskState, document_without_links

EventType = Literal[
    "task.queued",
    "task.started",
    "step.model_response",
    "step.tool_call",
    "step.completed",
    "task.awaiting_approval",
    "task.waiting",
    "wait.settled",
    "task.succeeded",
    "task.failed",
    "task.cancelled",
]
EVENT_TYPES: tuple[str, ...] = get_args(EventType)  # the one list of them
TERMINAL_EVENT_TYPES = ("task.succeeded", "task.failed", "task.cancelled")


@dataclass(frozen=True)
class Event:
    """An event of the log as read: whole, whatever its row holds of it."""

    seq: int
    type: str
    data: dict[str, Any]
    created_at: datetime


def model_response_data(
    step: int,
    said: dict[str, Any],
    *,
    input_tokens: int,
    output_tokens: int,
    cost_usd: float,
    cached_input_tokens: int = 0,
    cache_write_tokens: int = 0,
    reasoning_tokens: int = 0,
    prompt_tokens: int = 0,
) -> dict[str, Any]:
    """The ``step.model_response`` event: the answer (as its checkpoint holds it), its tool
    calls' ids and its usage (as ``/steps`` shows it). Built so when it is written and again
    when it is read."""
    calls = said.get("tool_calls")
    if calls:  # each call with the id the ledger and API use (copied: ``said`` is not changed)
        calls = [call | {"call_id": ledger.call_id(step, p)} for p, call in enumerate(calls)]
        said = said | {"tool_calls": calls}
    usage = {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cached_input_tokens": cached_input_tokens,
        "cache_write_tokens": cache_write_tokens,
        "reasoning_tokens": reasoning_tokens,
        "cost_usd": cost_usd,
        "prompt_tokens": prompt_tokens,
    }
    return {"step": step, **said, "usage": usage}


def list_events(
    session: Session,
    task_id: str,
    *,
    after: int = 0,
    limit: int = 500,
    approval_links: bool = False,
) -> list[Event]:
    """The events after ``after``, in order, whole: model responses put back together from
    their steps' checkpoint rows and calls' outcomes from their ledger rows (see
    ``fenced.stored_form``), in one more read for each kind there is.

    A waiting call's ``approval_url`` decides it without a key: it is left out unless the
    reader may decide (``approval_links``), so a caller that does not ask never hands it out."""
    rows = session.execute(
        select(TaskEvent.seq, TaskEvent.type, TaskEvent.data, TaskEvent.created_at)
        .where(TaskEvent.task_id == task_id, TaskEvent.seq > after)
        .order_by(TaskEvent.seq)
        .limit(limit)
    ).all()
    answers = {r.data["step"] for r in rows if names_step(r.type, r.data)}
    outcomes = {r.data["call_id"] for r in rows if names_call(r.type, r.data)}
    steps: dict[int, Step] = {}
    calls: dict[str, ToolCall] = {}
    if answers:
        query = select(Step).where(Step.task_id == task_id, Step.number.in_(answers))
        steps = {step.number: step for step in session.scalars(query)}
    if outcomes:
        called = select(ToolCall).where(ToolCall.task_id == task_id, ToolCall.call_id.in_(outcomes))
        calls = {call.call_id: call for call in session.scalars(called)}
    events = [
        Event(seq, type_, _whole(type_, data, steps, calls), created_at)
        for seq, type_, data, created_at in rows
    ]
    if approval_links:
        return events
    return [
        replace(e, data=document_without_links(e.data))
        if e.type.startswith("task.") or e.type == "step.tool_call"
        else e
        for e in events
    ]


def _whole(
    type_: str, data: dict[str, Any], steps: dict[int, Step], calls: dict[str, ToolCall]
) -> dict[str, Any]:
    if names_step(type_, data):
        step = steps[data["step"]]
        return model_response_data(
            step.number,
            step.response,
            input_tokens=step.input_tokens,
            output_tokens=step.output_tokens,
            cost_usd=step.cost_usd,
            cached_input_tokens=step.cached_input_tokens,
            cache_write_tokens=step.cache_write_tokens,
            reasoning_tokens=step.reasoning_tokens,
            prompt_tokens=step.prompt_tokens,
        )
    if names_call(type_, data):
        call = calls[data["call_id"]]
        return tool_call_data(
            call.step_number,
            call.call_id,
            name=call.tool,
            status=call.status,
            result=call.result,
            error=call.error,
        )
    return data


def tool_call_data(
    step: int, call_id: str, *, name: str, status: str, result: Any, error: str | None
) -> dict[str, Any]:
    """The ``step.tool_call`` event of a call's outcome: as its ledger row holds it. Built so
    when it is written (from the ledger's change) and again when it is read."""
    data = {"step": step, "call_id": call_id, "name": name, "status": status}
    return data | {"result": result, "error": error}


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
        events=[(type_, stored_form(type_, data)) for type_, data in resolved],
        deliveries=deliveries,
        now=utcnow(),
    )
    return [str(d["id"]) for d in deliveries]
