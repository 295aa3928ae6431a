"""The tool-call ledger: one row per tool call, unique on (task, call id).

A row goes ``started → succeeded | failed``; a call that needs approval first waits as
``awaiting`` (an approval starts it, a rejection ends it ``failed`` without a run); a call
that parked on a durable wait or a child task goes ``started → waiting`` and takes its
outcome from the wait once settled (``shared.store.waits``). A
``succeeded`` or ``failed`` row is final and is replayed, never re-run; a ``started`` row
found after a crash is a call whose outcome is unknown.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any, cast

from sqlalchemy import Table, select
from sqlalchemy.orm import Session

from shared.store.batch import Add, Change, Increment
from shared.store.leases import Lease
from shared.store.tables import ToolCall, utcnow

_CALLS = cast(Table, ToolCall.__table__)


class CallStatus(StrEnum):
    """A tool call's ledger row: ``started → succeeded | failed``, or ``awaiting`` first."""

    STARTED = "started"
    AWAITING = "awaiting"  # waits for a person's decision before it may run
    WAITING = "waiting"  # ran, and waits for its outcome: a durable wait or a child task
    SUCCEEDED = "succeeded"
    FAILED = "failed"


def call_id(step: int, position: int) -> str:
    """The call's id everywhere Ratchet names it: "<step>-<position in the model's answer>"."""
    return f"{step}-{position}"


def idempotency_key(task_id: str, call_id: str) -> str:
    """The call's key, the same on every run of it: not stored, it is its row's own key."""
    return f"{task_id}:{call_id}"


def calls_for_task(
    session: Session, task_id: str, *, steps: Sequence[int] | None = None
) -> Sequence[ToolCall]:
    query = select(ToolCall).where(ToolCall.task_id == task_id)
    if steps is not None:
        query = query.where(ToolCall.step_number.in_(steps))
    return session.scalars(query.order_by(ToolCall.step_number, ToolCall.position)).all()


def start_call(
    lease: Lease,
    *,
    position: int,
    call_id: str,
    provider_call_id: str,
    tool: str,
    arguments: dict[str, Any],
) -> Add:
    """The ``started`` row, written with a fenced write before the tool runs; the unique
    (task, call id) turns a duplicate away."""
    return Add(
        _CALLS,
        {
            "task_id": lease.task_id,
            "step_number": lease.step,
            "position": position,
            "call_id": call_id,
            "provider_call_id": provider_call_id,
            "tool": tool,
            "arguments": arguments,
            "status": CallStatus.STARTED,
            "runs": 1,
            "lease_epoch": lease.epoch,
            "started_at": utcnow(),
        },
    )


def await_decision(
    lease: Lease,
    *,
    position: int,
    call_id: str,
    provider_call_id: str,
    tool: str,
    arguments: dict[str, Any],
    deadline_ms: int,
    on_timeout: str,
) -> Add:
    """The row of a call that must be approved before it runs: written with the fenced write
    that puts the task to wait, it is not run (``runs`` 0) until a decision says so."""
    row = start_call(
        lease,
        position=position,
        call_id=call_id,
        provider_call_id=provider_call_id,
        tool=tool,
        arguments=arguments,
    )
    waits = {
        "status": CallStatus.AWAITING,
        "runs": 0,
        "approval_deadline_ms": deadline_ms,
        "approval_on_timeout": on_timeout,
    }
    return Add(_CALLS, row.values | waits)


def extend_wait(call_id: str, *, deadline_ms: int) -> Change:
    """A new deadline for a call still waiting (its task was retried after the last one)."""
    return Change(
        _CALLS,
        {"call_id": call_id, "status": CallStatus.AWAITING},
        {"approval_deadline_ms": deadline_ms},
    )


def start_approved_call(lease: Lease, call_id: str) -> Change:
    """An approved (or edited) call starts: ``awaiting`` → ``started``, one more run."""
    return Change(
        _CALLS,
        {"call_id": call_id, "status": CallStatus.AWAITING},
        {
            "status": CallStatus.STARTED,
            "runs": Increment(1),
            "lease_epoch": lease.epoch,
            "started_at": utcnow(),
        },
    )


def ask_again(call_id: str, *, deadline_ms: int, on_timeout: str) -> Change:
    """A ``started`` call whose outcome is unknown, of a tool whose policy is ``ask``: it
    waits for a person to say whether to run it again."""
    return Change(
        _CALLS,
        {"call_id": call_id, "status": CallStatus.STARTED},
        {
            "status": CallStatus.AWAITING,
            "approval_deadline_ms": deadline_ms,
            "approval_on_timeout": on_timeout,
        },
    )


def reject_call(call_id: str, *, error: str) -> Change:
    """A rejected call never runs: ``awaiting`` → ``failed``, the rejection as its error."""
    return Change(
        _CALLS,
        {"call_id": call_id, "status": CallStatus.AWAITING},
        {"status": CallStatus.FAILED, "error": error, "finished_at": utcnow()},
    )


def rerun(lease: Lease, call_id: str) -> Change:
    """One more run of a ``started`` call whose first run's outcome is unknown."""
    return Change(
        _CALLS,
        {"call_id": call_id, "status": CallStatus.STARTED},
        {"runs": Increment(1), "lease_epoch": lease.epoch},
    )


def finish_call(
    call_id: str, *, status: str, result: Any = None, error: str | None = None
) -> Change:
    """The call's outcome; only a ``started`` row changes (a finished call is final)."""
    assert status in (CallStatus.SUCCEEDED, CallStatus.FAILED)
    return Change(
        _CALLS,
        {"call_id": call_id, "status": CallStatus.STARTED},
        {"status": status, "result": result, "error": error, "finished_at": utcnow()},
    )


def park_call(call_id: str) -> Change:
    """The call ran and parked: its outcome is its wait's, once settled."""
    return Change(
        _CALLS, {"call_id": call_id, "status": CallStatus.STARTED}, {"status": CallStatus.WAITING}
    )


def finish_waiting_call(
    call_id: str, *, status: str, result: Any = None, error: str | None = None
) -> Change:
    """A parked call's outcome, from its settled wait; only a ``waiting`` row changes."""
    assert status in (CallStatus.SUCCEEDED, CallStatus.FAILED)
    return Change(
        _CALLS,
        {"call_id": call_id, "status": CallStatus.WAITING},
        {"status": status, "result": result, "error": error, "finished_at": utcnow()},
    )
