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

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from shared.agents.registry import get_registry
from shared.errors import Conflict, InvalidRequest, NotFound, ToolArgumentsInvalid
from shared.statuses import Decision, TaskStatus
from shared.store import tasks
from shared.store.db import now_ms
from shared.store.ledger import CallStatus
from shared.store.tables import Task, ToolCall, utcnow


@dataclass(frozen=True)
class Decided:
    """A decision as stored; ``resumed``: it was the step's last, and the task runs again
    (the caller enqueues its step once committed); ``replayed``: it had been made before."""

    call: ToolCall
    task: Task
    resumed: bool
    replayed: bool
    deliveries: list[str]


def _same(call: ToolCall, decision: str, arguments: dict[str, Any] | None) -> bool:
    return call.decision == decision and (decision != Decision.EDIT or arguments == call.arguments)


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
    assert decision in tuple(Decision)
    task = tasks.lock_task(session, task_id, tenant_id)
    call = session.scalar(
        select(ToolCall).where(ToolCall.task_id == task_id, ToolCall.call_id == call_id)
    )
    if call is None or (call.decision is None and call.status != CallStatus.AWAITING):
        raise NotFound(f"no call {call_id} of task {task_id} waits for a decision")
    if call.decision is not None:
        if _same(call, decision, arguments):
            return Decided(call, task, resumed=False, replayed=True, deliveries=[])
        raise Conflict(f"call {call_id} was already decided: {call.decision} by {call.decided_by}")
    if task.status != TaskStatus.AWAITING_APPROVAL:
        raise Conflict(f"task {task_id} is {task.status}: its calls no longer wait")
    if decision == Decision.EDIT:
        call.original_arguments, call.arguments = call.arguments, _checked(call, arguments)
    call.decision, call.decided_by, call.decision_reason = decision, decided_by, reason
    call.decided_at = utcnow()
    session.flush()
    pending = _still_pending(session, task, call)
    deliveries = tasks.record_decision(session, task, _event(call), pending=pending)
    return Decided(call, task, resumed=pending is None, replayed=False, deliveries=deliveries)


def _still_pending(session: Session, task: Task, decided: ToolCall) -> dict[str, Any] | None:
    """The task's ``pending_approval`` with only the step's calls still undecided; None when
    none is."""
    waiting = session.scalars(
        select(ToolCall.call_id).where(
            ToolCall.task_id == task.id,
            ToolCall.step_number == decided.step_number,
            ToolCall.status == CallStatus.AWAITING,
            ToolCall.decision.is_(None),
        )
    ).all()
    if not waiting:
        return None
    pending = dict(task.pending_approval or {})
    pending["calls"] = [c for c in pending.get("calls", []) if c["call_id"] in waiting]
    return pending


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


# The deadline's policies that decide the call (the other one, "fail", fails the task).
TIMEOUT_DECISIONS = {"reject": Decision.REJECT, "approve": Decision.APPROVE}


def due(session: Session, *, limit: int = 500) -> Sequence[tuple[str, str, str]]:
    """(task id, call id, policy) of undecided calls past their deadline, on the database's
    clock, whose task still waits."""
    rows = session.execute(
        select(ToolCall.task_id, ToolCall.call_id, ToolCall.approval_on_timeout)
        .join(Task, Task.id == ToolCall.task_id)
        .where(
            ToolCall.status == CallStatus.AWAITING,
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
    task = tasks.lock_task(session, task_id, None)
    if task.status != TaskStatus.AWAITING_APPROVAL:
        return False, []
    error = {"type": "approval_timeout", "message": f"tool call {call_id}: {reason}"}
    return False, tasks.fail_awaiting(session, task, error)


def count_waiting(session: Session, tenant_id: str | None) -> int:
    query = (
        select(func.count()).select_from(Task).where(Task.status == TaskStatus.AWAITING_APPROVAL)
    )
    if tenant_id is not None:
        query = query.where(Task.tenant_id == tenant_id)
    return int(session.scalar(query) or 0)
