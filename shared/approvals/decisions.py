"""Deciding a waiting tool call, exactly once.

A decision locks the task's row first (an UPDATE, which also takes SQLite's write lock before
anything is read), so decisions on one task, and the deadline's, happen one after another:
the first one on a call wins; the same decision again is answered with the stored one; a
different one is a Conflict. When the last waiting call of the step is decided, the task goes
back to ``running`` and a worker runs the step's approved calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from shared.agents.registry import get_registry
from shared.errors import Conflict, InvalidRequest, NotFound, ToolArgumentsInvalid
from shared.observability import metrics
from shared.store import ledger, outbox
from shared.store.db import now_ms
from shared.store.events import insert_events
from shared.store.tables import Task, TaskStatus, ToolCall, utcnow
from shared.store.writes import terminal_values
from shared.views import task_document

DECISIONS = ("approve", "edit", "reject")


@dataclass(frozen=True)
class Decided:
    """A decision as stored; ``resumed``: it was the step's last, and the task runs again
    (the caller enqueues its step once committed); ``replayed``: it had been made before."""

    call: ToolCall
    task: Task
    resumed: bool
    replayed: bool
    deliveries: list[str]


def _lock(session: Session, task_id: str, tenant_id: str | None) -> Task:
    query = update(Task).where(Task.id == task_id)
    if tenant_id is not None:
        query = query.where(Task.tenant_id == tenant_id)
    locked = session.execute(query.values(updated_at=Task.updated_at))
    if locked.rowcount != 1:  # type: ignore[attr-defined]
        raise NotFound(f"no task {task_id}")
    task = session.get(Task, task_id, populate_existing=True)
    assert task is not None
    return task


def _same(call: ToolCall, decision: str, arguments: dict[str, Any] | None) -> bool:
    return call.decision == decision and (decision != "edit" or arguments == call.arguments)


def _checked(call: ToolCall, arguments: dict[str, Any] | None) -> dict[str, Any]:
    if arguments is None:
        raise InvalidRequest("arguments", "an edit gives the arguments to run the call with")
    tool = get_registry().tools.get(call.tool)
    if tool is not None:
        try:
            tool.validate_arguments(arguments)
        except ToolArgumentsInvalid as exc:
            raise InvalidRequest("arguments", str(exc)) from None
    return arguments


def decide(
    session: Session,
    task_id: str,
    call_id: str,
    *,
    decision: str,
    decided_by: str,
    tenant_id: str | None,
    arguments: dict[str, Any] | None = None,
    reason: str | None = None,
) -> Decided:
    """Record ``decision`` on the waiting call (``tenant_id`` None: the deadline's, for any
    tenant). NotFound if no such call waits; Conflict if it was decided otherwise or its task
    no longer waits (cancelled, timed out); InvalidRequest for an edit its tool refuses."""
    assert decision in DECISIONS
    task = _lock(session, task_id, tenant_id)
    call = session.scalar(
        select(ToolCall).where(ToolCall.task_id == task_id, ToolCall.call_id == call_id)
    )
    if call is None or (call.decision is None and call.status != ledger.AWAITING):
        raise NotFound(f"no call {call_id} of task {task_id} waits for a decision")
    if call.decision is not None:
        if _same(call, decision, arguments):
            return Decided(call, task, resumed=False, replayed=True, deliveries=[])
        raise Conflict(f"call {call_id} was already decided: {call.decision} by {call.decided_by}")
    if task.status != TaskStatus.AWAITING_APPROVAL:
        raise Conflict(f"task {task_id} is {task.status}: its calls no longer wait")
    if decision == "edit":
        call.original_arguments, call.arguments = call.arguments, _checked(call, arguments)
    call.decision, call.decided_by, call.decision_reason = decision, decided_by, reason
    call.decided_at = utcnow()
    session.flush()
    resumed = _still_waiting(session, task, call) == []
    if resumed:
        task.status, task.pending_approval, task.due_ms = TaskStatus.RUNNING, None, now_ms()
        task.admitted_ms = None  # back in the backlog: the dispatcher admits its next step
    task.last_event_seq += 1
    task.updated_at = utcnow()
    session.flush()
    session.refresh(task)
    deliveries = insert_events(
        session,
        [("step.tool_call", _event(call))],
        task=task,
        subscriptions=outbox.subscriptions_for(session, task),
    )
    return Decided(call, task, resumed=resumed, replayed=False, deliveries=deliveries)


def _still_waiting(session: Session, task: Task, decided: ToolCall) -> list[str]:
    """The step's calls still undecided; the task's ``pending_approval`` lists only them."""
    waiting = session.scalars(
        select(ToolCall.call_id).where(
            ToolCall.task_id == task.id,
            ToolCall.step_number == decided.step_number,
            ToolCall.status == ledger.AWAITING,
            ToolCall.decision.is_(None),
        )
    ).all()
    pending = dict(task.pending_approval or {})
    pending["calls"] = [c for c in pending.get("calls", []) if c["call_id"] in waiting]
    task.pending_approval = pending
    return list(waiting)


def _event(call: ToolCall) -> dict[str, Any]:
    return {
        "step": call.step_number,
        "call_id": call.call_id,
        "name": call.tool,
        "status": call.status,
        "decision": call.decision,
        "decided_by": call.decided_by,
        "reason": call.decision_reason,
        "arguments": call.arguments,
    }


TIMEOUT_DECISIONS = {"reject": "reject", "approve": "approve"}


def due(session: Session, *, limit: int = 500) -> Sequence[tuple[str, str, str]]:
    """(task id, call id, policy) of undecided calls past their deadline, on the database's
    clock, whose task still waits."""
    rows = session.execute(
        select(ToolCall.task_id, ToolCall.call_id, ToolCall.approval_on_timeout)
        .join(Task, Task.id == ToolCall.task_id)
        .where(
            ToolCall.status == ledger.AWAITING,
            ToolCall.decision.is_(None),
            ToolCall.approval_deadline_ms <= now_ms(),
            Task.status == TaskStatus.AWAITING_APPROVAL,
        )
        .limit(limit)
    )
    return [(t, c, p or "reject") for t, c, p in rows.tuples()]


def expire(session: Session, task_id: str, call_id: str, policy: str) -> tuple[bool, list[str]]:
    """Apply the deadline's policy to one call, exactly once: reject or approve it (as
    ``timeout``), or fail its task; nothing if a person's decision got there first. Returns
    whether the task runs again, and the webhook deliveries to send once committed."""
    reason = "no decision before the deadline"
    if policy in TIMEOUT_DECISIONS:
        try:
            decided = decide(
                session,
                task_id,
                call_id,
                decision=TIMEOUT_DECISIONS[policy],
                decided_by="timeout",
                tenant_id=None,
                reason=reason,
            )
        except (Conflict, NotFound):
            return False, []
        return decided.resumed, decided.deliveries
    task = _lock(session, task_id, None)
    if task.status != TaskStatus.AWAITING_APPROVAL:
        return False, []
    error = {"type": "approval_timeout", "message": f"tool call {call_id}: {reason}"}
    for key, value in terminal_values(TaskStatus.FAILED, error=error).items():
        setattr(task, key, value)
    task.lease_epoch += 1
    task.last_event_seq += 1
    session.flush()
    session.refresh(task)
    metrics.tasks_finished.labels(status=TaskStatus.FAILED).inc()
    deliveries = insert_events(
        session,
        [("task.failed", task_document)],
        task=task,
        subscriptions=outbox.subscriptions_for(session, task),
    )
    return False, deliveries


def count_waiting(session: Session, tenant_id: str | None) -> int:
    query = (
        select(func.count()).select_from(Task).where(Task.status == TaskStatus.AWAITING_APPROVAL)
    )
    if tenant_id is not None:
        query = query.where(Task.tenant_id == tenant_id)
    return int(session.scalar(query) or 0)
