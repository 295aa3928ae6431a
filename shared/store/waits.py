"""Durable waits: a tool call parked on the outside world or on a child task, one row each,
settled exactly once (``pending → completed | failed | expired | cancelled``).

A call parks with a fenced write of its step (the ledger row ``started → waiting`` and this
row, together); the wait is settled outside any step (a completion, a child's end, the
deadline, a cancel) by a conditional update that only a pending row matches; the step that
resumes the task reads the settled row and commits the call's outcome from it.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from enum import StrEnum
from typing import Any, cast

from sqlalchemy import Table, func, select, update
from sqlalchemy.orm import Session

from shared.agents.waiting import Parking
from shared.statuses import TERMINAL_STATUSES, TaskStatus, in_order
from shared.store.batch import Add
from shared.store.db import now_ms
from shared.store.leases import Lease
from shared.store.tables import Task, Wait, utcnow

_WAITS = cast(Table, Wait.__table__)


class WaitStatus(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"  # completed from outside, or its child succeeded
    FAILED = "failed"  # its child failed or was cancelled
    EXPIRED = "expired"  # its deadline passed (``on_timeout`` said what then)
    CANCELLED = "cancelled"  # its task was cancelled while it waited


def new_token() -> str:
    """A wait's token: unguessable, since with the signed URL it completes the wait."""
    return "wt_" + secrets.token_urlsafe(24)


def park(
    lease: Lease,
    *,
    token: str,
    call_id: str,
    tenant_id: str,
    parking: Parking,
    deadline_ms: int | None,
    on_timeout: str,
) -> Add:
    """The wait's row, written with the fenced write that parks its call."""
    return Add(
        _WAITS,
        {
            "token": token,
            "task_id": lease.task_id,
            "tenant_id": tenant_id,
            "call_id": call_id,
            "step_number": lease.step,
            "kind": parking.kind,
            "child_id": parking.child_id,
            "status": WaitStatus.PENDING,
            "request": parking.request,
            "deadline_ms": deadline_ms,
            "on_timeout": on_timeout,
            "created_at": utcnow(),
        },
    )


def of_step(session: Session, task_id: str, step: int) -> dict[str, Wait]:
    """The step's waits by call id."""
    rows = session.scalars(select(Wait).where(Wait.task_id == task_id, Wait.step_number == step))
    return {row.call_id: row for row in rows}


def of_calls(session: Session, task_id: str, call_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The waits of these calls of the task, as clients read them, by call id (none: {})."""
    if not call_ids:
        return {}
    rows = session.scalars(select(Wait).where(Wait.task_id == task_id, Wait.call_id.in_(call_ids)))
    return {row.call_id: public(row) for row in rows}


def by_token(session: Session, token: str) -> Wait | None:
    return session.get(Wait, token, populate_existing=True)


def settle(
    session: Session,
    token: str,
    *,
    status: WaitStatus,
    payload: Any = None,
    error: str | None = None,
    by: str,
) -> bool:
    """Settle a pending wait, once: whether this call did (a settled wait stays as it is)."""
    assert status != WaitStatus.PENDING
    done = session.execute(
        update(Wait)
        .where(Wait.token == token, Wait.status == WaitStatus.PENDING)
        .values(status=status, payload=payload, error=error, settled_at=utcnow(), settled_by=by)
        .execution_options(synchronize_session=False)
    )
    return done.rowcount == 1  # type: ignore[attr-defined,no-any-return]


def pending_count(session: Session, task_id: str) -> int:
    query = select(func.count()).where(Wait.task_id == task_id, Wait.status == WaitStatus.PENDING)
    return int(session.scalar(query) or 0)


def cancel_pending(session: Session, task_ids: Sequence[str]) -> None:
    """The pending waits of tasks that were cancelled: settled as ``cancelled``."""
    if task_ids:
        session.execute(
            update(Wait)
            .where(Wait.task_id.in_(task_ids), Wait.status == WaitStatus.PENDING)
            .values(status=WaitStatus.CANCELLED, settled_at=utcnow(), settled_by="cancel")
            .execution_options(synchronize_session=False)
        )


def due(session: Session, *, limit: int = 500) -> Sequence[tuple[str, str]]:
    """(token, task id) of pending waits on the outside world past their deadline, on the
    database's clock."""
    rows = session.execute(
        select(Wait.token, Wait.task_id)
        .where(
            Wait.status == WaitStatus.PENDING,
            Wait.deadline_ms <= now_ms(),
            Wait.kind == "token",
        )
        .limit(limit)
    )
    return list(rows.tuples())


def children_ended(session: Session, *, limit: int = 500) -> Sequence[str]:
    """Child tasks that ended while their parent's wait on them is still pending: what a
    crash between a child's end and its parent's settling left behind."""
    rows = session.scalars(
        select(Wait.child_id)
        .join(Task, Task.id == Wait.child_id)
        .where(Wait.status == WaitStatus.PENDING, Task.status.in_(in_order(TERMINAL_STATUSES)))
        .limit(limit)
    )
    return [row for row in rows if row is not None]


def waiting_without_pending(session: Session, *, limit: int = 500) -> Sequence[str]:
    """Tasks still ``waiting`` with none of their waits pending: what a crash between the
    last settling and the task's resume left behind."""
    pending = select(Wait.token).where(Wait.task_id == Task.id, Wait.status == "pending")
    rows = session.scalars(
        select(Task.id).where(Task.status == TaskStatus.WAITING, ~pending.exists()).limit(limit)
    )
    return list(rows)


def public(wait: Wait | dict[str, Any]) -> dict[str, Any]:
    """A wait as clients read it (in ``/steps``, events and ``GET /v1/waits/{token}``)."""
    row = wait if isinstance(wait, dict) else {c.key: getattr(wait, c.key) for c in _WAITS.c}
    return {
        "token": row["token"],
        "call_id": row["call_id"],
        "kind": row["kind"],
        "child_id": row["child_id"],
        "status": row["status"],
        "request": row["request"],
        "deadline_ms": row["deadline_ms"],
        "on_timeout": row["on_timeout"],
    }
