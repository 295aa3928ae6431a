"""The tool-call ledger: one row per tool call, unique on (task, call id).

A row goes ``started → succeeded | failed``. A ``succeeded`` or ``failed`` row is final and
is replayed, never re-run; a ``started`` row found after a crash is a call whose outcome is
unknown.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import Table, insert, select, update
from sqlalchemy.orm import Session

from shared.models import ToolCall, utcnow
from shared.task_store import Lease

_INSERT_CALL = insert(cast(Table, ToolCall.__table__))  # built once: it runs every call
STARTED = "started"
SUCCEEDED = "succeeded"
FAILED = "failed"


def call_id(step: int, position: int) -> str:
    """The call's id everywhere Ratchet names it: "<step>-<position in the model's answer>"."""
    return f"{step}-{position}"


def idempotency_key(task_id: str, call_id: str) -> str:
    return f"{task_id}:{call_id}"


def calls_for_task(
    session: Session, task_id: str, *, steps: Sequence[int] | None = None
) -> Sequence[ToolCall]:
    query = select(ToolCall).where(ToolCall.task_id == task_id)
    if steps is not None:
        query = query.where(ToolCall.step_number.in_(steps))
    return session.scalars(query.order_by(ToolCall.step_number, ToolCall.position)).all()


def start_call(
    session: Session,
    lease: Lease,
    *,
    position: int,
    call_id: str,
    provider_call_id: str,
    tool: str,
    arguments: dict[str, Any],
) -> None:
    """Insert the ``started`` row; the unique (task, call id) turns a duplicate away."""
    row = {
        "task_id": lease.task_id,
        "step_number": lease.step,
        "position": position,
        "call_id": call_id,
        "provider_call_id": provider_call_id,
        "tool": tool,
        "arguments": arguments,
        "status": STARTED,
        "idempotency_key": idempotency_key(lease.task_id, call_id),
        "runs": 1,
        "lease_epoch": lease.epoch,
        "started_at": utcnow(),
    }
    session.execute(_INSERT_CALL, row)


def restart_call(session: Session, lease: Lease, call_id: str) -> None:
    """Count one more run of a ``started`` call whose first run's outcome is unknown."""
    session.execute(
        update(ToolCall)
        .where(ToolCall.task_id == lease.task_id, ToolCall.call_id == call_id)
        .where(ToolCall.status == STARTED)
        .values(runs=ToolCall.runs + 1, lease_epoch=lease.epoch)
        .execution_options(synchronize_session=False)
    )


def finish_call(
    session: Session,
    lease: Lease,
    call_id: str,
    *,
    status: str,
    result: Any = None,
    error: str | None = None,
) -> bool:
    """Record the call's outcome. Only a ``started`` row changes; returns whether it did."""
    assert status in (SUCCEEDED, FAILED)
    done = session.execute(
        update(ToolCall)
        .where(ToolCall.task_id == lease.task_id, ToolCall.call_id == call_id)
        .where(ToolCall.status == STARTED)
        .values(status=status, result=result, error=error, finished_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    return done.rowcount == 1  # type: ignore[attr-defined,no-any-return]
