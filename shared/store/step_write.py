"""The one fenced write of a step, and the values a step's outcomes write with it.

Only a holder of the task's current lease epoch can write: every write is an UPDATE of the task
row conditional on that epoch, carrying the step's checkpoint and ledger rows, its events and
their webhook deliveries, all or nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NoReturn

from sqlalchemy import ColumnElement, Select, Update, bindparam, select, update
from sqlalchemy.orm import Session

from shared.errors import CancelRequested, LeaseLost
from shared.observability import metrics
from shared.statuses import RUNNABLE_STATUSES, TERMINAL_STATUSES, TaskStatus, in_order
from shared.store.backends import backend_of, run_batch
from shared.store.batch import Batch, Increment, Part
from shared.store.db import now_ms
from shared.store.fenced import (
    TASKS,
    EventSpec,
    FromNow,
    assignments,
    check_in_range,
    log_in_batch,
    params_of,
    predict,
    runnable,
    settle,
    shape_of,
)
from shared.store.tables import Task, utcnow
from shared.views import TaskState, task_document

if TYPE_CHECKING:
    from shared.store.leases import Lease

CANCELLED_ERROR = {"type": "cancelled", "message": "cancelled at the client's request"}
# Counts within a call's tokens: of the input, read from and written to the provider's prompt
# cache; of the output, spent reasoning.
USAGE_DETAILS = ("cached_input_tokens", "cache_write_tokens", "reasoning_tokens")


def _fence(*, honour_cancel: bool) -> ColumnElement[bool]:
    c = TASKS.c
    condition = (c.id == bindparam("b_task_id")) & (c.lease_epoch == bindparam("b_epoch"))
    condition &= runnable(c.status)
    if honour_cancel:
        condition &= c.cancel_requested_at.is_(None)
    return condition


@lru_cache(maxsize=128)
def _write_statement(shape: tuple[tuple[str, str], ...], *, honour_cancel: bool) -> Update:
    """The fenced UPDATE for one shape of write, built once and reused with new parameters:
    every write of a step runs one, so building and keying it each time would dominate."""
    c = TASKS.c
    return (
        update(TASKS)
        .where(_fence(honour_cancel=honour_cancel))
        .values(assignments(shape))
        .returning(c.id, c.last_event_seq, now_ms().label("clock_ms"))
    )


@lru_cache(maxsize=2)
def _lock_statement(*, honour_cancel: bool) -> Select[Any]:
    """The fence of a write that changes nothing of the task row (a tool call's start) on
    PostgreSQL: the row locked as the UPDATE would lock it, so a lease-taker or a cancel
    waits for the commit and then sees it, with no new version of the row written (and the
    foreign keys' checks of the rows it adds need no lock of their own)."""
    c = TASKS.c
    return (
        select(c.id, c.last_event_seq, now_ms().label("clock_ms"))
        .where(_fence(honour_cancel=honour_cancel))
        .with_for_update(key_share=True)  # FOR NO KEY UPDATE, as an UPDATE of the row takes
    )


@dataclass(frozen=True)
class Written:
    """A fenced write that happened: the task row as it left it, and the webhook deliveries
    its events queued (to be sent once it commits)."""

    task: TaskState
    deliveries: list[str]


def write(
    session: Session,
    lease: Lease,
    *,
    task: TaskState,
    change: TaskWrite,
    parts: Sequence[Part] = (),
) -> Written:
    """The one fenced write of a step: check the lease, extend it, make ``change`` (its values
    and events), and write ``parts`` (checkpoint and ledger rows) — all or nothing.

    The fence is an UPDATE of the task row conditional on the lease epoch (on PostgreSQL, a
    write that changes nothing of the row locks it instead): only a holder of the current
    epoch can write, and a competing lease-taker waits on its row lock and then sees the
    bumped epoch. On PostgreSQL the whole write is one statement (see shared.store.batch).
    ``task`` is the row as this lease holder last left it. Raises LeaseLost if the epoch
    moved on, CancelRequested if the client asked to cancel (unless the change is the cancel).
    """
    events, honour_cancel = change.events, change.honour_cancel
    now = utcnow()
    changes: dict[str, Any] = {}
    # SQLite has no row locks: there the UPDATE's own write is what makes the transaction a
    # writer before it checks the epoch.
    locks = not change.values and not events and backend_of(session).locks_rows
    if not locks:
        changes["lease_expires_ms"] = FromNow(lease.ttl_ms)
        changes["last_event_seq"] = Increment(len(events))
    if change.values or events:
        # A write that only fences its rows (a tool call's start) changes none of the columns
        # a Task document shows: where it must update the row, it leaves ``updated_at``.
        changes["updated_at"] = now
    changes |= change.values
    shape = shape_of(changes)
    fenced = Batch(
        fence=(
            _lock_statement(honour_cancel=honour_cancel)
            if locks
            else _write_statement(shape, honour_cancel=honour_cancel)
        ),
        key=("write", shape, honour_cancel),
        params=params_of(changes) | {"b_task_id": lease.task_id, "b_epoch": lease.epoch},
        parts=list(parts),
        now=now,
    )
    after = predict(task, changes)
    check_in_range(after, changes)
    if events:
        log_in_batch(session, fenced, events, task=after)
    row = run_batch(session, fenced)
    if row is None:
        _refuse(session, lease)
    settle(after, row)
    if after.status in TERMINAL_STATUSES:
        metrics.tasks_finished.labels(status=after.status).inc()
    return Written(after, [d["id"] for d in fenced.deliveries])


def _refuse(session: Session, lease: Lease) -> NoReturn:
    """Why a fenced write matched nothing: a requested cancel, else a lost lease."""
    cancel = session.scalar(select(Task.cancel_requested_at).where(_held(lease)))
    if cancel is not None:
        raise CancelRequested(f"task {lease.task_id}: cancellation requested")
    raise LeaseLost(f"task {lease.task_id}: lease epoch {lease.epoch} is no longer current")


def _held(lease: Lease) -> ColumnElement[bool]:
    return (
        (Task.id == lease.task_id)
        & (Task.lease_epoch == lease.epoch)
        & Task.status.in_(in_order(RUNNABLE_STATUSES))
    )


def usage_values(
    *, input_tokens: int, output_tokens: int, cost_usd: float, **details: int
) -> dict[str, Any]:
    """The increments of a task's usage. ``details`` are the counts within those tokens
    (``cached_input_tokens``, ``cache_write_tokens``, ``reasoning_tokens``): each is written
    only when there is some, so a call without them writes what it always did."""
    values: dict[str, Any] = {
        "input_tokens": Increment(input_tokens),
        "output_tokens": Increment(output_tokens),
        "cost_usd": Increment(cost_usd),
    }
    unknown = set(details) - set(USAGE_DETAILS)
    if unknown:
        raise TypeError(f"not usage counts: {sorted(unknown)}")
    values.update({name: Increment(count) for name, count in details.items() if count})
    return values


def progress_values(lease: Lease, *, next_owner: str | None = None) -> dict[str, Any]:
    """``lease.step`` is done: free the task for the next step's message (due now), or, with
    ``next_owner``, lease the next step to it in the same write (see :func:`next_lease`).

    The in-place write changes no indexed column of the task (its due time stays where it
    was), so PostgreSQL updates the row in place (HOT): no new entry in any of the task's
    indexes, at every step. Its due time is not needed while it is leased: if the worker
    dies, the lease running out is what makes the task overdue to the sweeper, and its
    older due time only makes that sooner."""
    values: dict[str, Any] = {
        "steps": lease.step,
        "attempt": 0,
        "model_failures": 0,
        "waiting": None,
        "lease_owner": None,
        "lease_expires_ms": None,
    }
    if next_owner is None:
        return values | {"due_ms": FromNow(0)}
    return values | {
        "lease_epoch": Increment(1),
        "lease_owner": next_owner,
        "lease_expires_ms": FromNow(lease.ttl_ms),
        "attempt": 1,
    }


def release_values(
    lease: Lease,
    *,
    delay_ms: int = 0,
    model_failures: int | None = None,
    waiting: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Give the lease back without progress (a wait); the attempt does not count.

    ``waiting`` says why (shown on the step timeline until the step moves on).
    """
    values: dict[str, Any] = {
        "waiting": waiting,
        "attempt": Increment(-1),
        "lease_owner": None,
        "lease_expires_ms": None,
        "due_ms": FromNow(delay_ms),
        "admitted_ms": None,  # its slots are free while it waits; the dispatcher re-admits it
    }
    if model_failures is not None:
        values["model_failures"] = model_failures
    return values


def terminal_values(
    status: str,
    *,
    result: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    steps: int | None = None,
) -> dict[str, Any]:
    """The values that end a task (pair with its ``task.<status>`` event)."""
    assert status in TERMINAL_STATUSES
    values: dict[str, Any] = {
        "status": status,
        "result": result,
        "error": error,
        "finished_at": utcnow(),
        "updated_at": utcnow(),
        "lease_owner": None,
        "lease_expires_ms": None,
        "due_ms": None,
        "cancel_requested_at": None,
        "model_failures": 0,
        "waiting": None,
        "pending_approval": None,
    }
    if steps is not None:
        values["steps"] = steps
    return values


@dataclass(frozen=True)
class TaskWrite:
    """What one fenced write does to the task row and its log: the values it sets and the
    events it appends. Built by the intents below, combined with ``then``, made by ``write``."""

    values: dict[str, Any] = field(default_factory=dict)
    events: tuple[EventSpec, ...] = ()
    # False for a write that a pending cancel must not refuse (the cancel itself).
    honour_cancel: bool = True

    def then(self, other: TaskWrite) -> TaskWrite:
        """Both in the same write: ``other``'s values win, its events come after."""
        return TaskWrite(
            {**self.values, **other.values},
            self.events + other.events,
            self.honour_cancel and other.honour_cancel,
        )


def log_events(*events: EventSpec) -> TaskWrite:
    """Append events, changing nothing else."""
    return TaskWrite(events=events)


def finish_task(
    status: str,
    *,
    result: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    steps: int | None = None,
) -> TaskWrite:
    """End the task: its terminal values and its ``task.<status>`` event, always together.
    A cancellation is written even with a cancel pending: it is what the cancel asked for."""
    return TaskWrite(
        terminal_values(status, result=result, error=error, steps=steps),
        ((f"task.{status}", task_document),),
        honour_cancel=status != TaskStatus.CANCELLED,
    )


def complete_step(lease: Lease, *, next_owner: str | None = None) -> TaskWrite:
    """``lease.step`` is done (``step.completed``); with ``next_owner``, the same write
    leases the next step to it (see ``leases.next_lease``)."""
    return TaskWrite(
        progress_values(lease, next_owner=next_owner), (("step.completed", {"step": lease.step}),)
    )


def release(
    lease: Lease,
    *,
    delay_ms: int = 0,
    model_failures: int | None = None,
    waiting: dict[str, Any] | None = None,
) -> TaskWrite:
    """Give the lease back without progress, to come back after ``delay_ms``."""
    return TaskWrite(
        release_values(lease, delay_ms=delay_ms, model_failures=model_failures, waiting=waiting)
    )


def add_usage(
    *, input_tokens: int, output_tokens: int, cost_usd: float, **details: int
) -> TaskWrite:
    """Add a model call's tokens and cost to the task's totals (``details``: see
    :func:`usage_values`)."""
    return TaskWrite(
        usage_values(
            input_tokens=input_tokens, output_tokens=output_tokens, cost_usd=cost_usd, **details
        )
    )


def await_approval(pending: dict[str, Any]) -> TaskWrite:
    """The step's calls in ``pending`` wait for a person: the task leaves the workers
    (``awaiting_approval``, no lease, no due time, the attempt not counted) until every one
    of them is decided, with ``task.awaiting_approval`` carrying what waits."""
    values: dict[str, Any] = {
        "status": TaskStatus.AWAITING_APPROVAL,
        "pending_approval": pending,
        "waiting": None,
        "attempt": Increment(-1),
        "lease_owner": None,
        "lease_expires_ms": None,
        "due_ms": None,
    }
    return TaskWrite(values, (("task.awaiting_approval", task_document),))


def await_waits(waiting: dict[str, Any]) -> TaskWrite:
    """The step's calls in ``waiting`` are parked on durable waits or child tasks: the task
    leaves the workers (``waiting``: no lease, no due time, no slot, the attempt not counted)
    until every one is settled, with ``task.waiting`` saying what waits."""
    values: dict[str, Any] = {
        "status": TaskStatus.WAITING,
        "waiting": waiting,
        "attempt": Increment(-1),
        "lease_owner": None,
        "lease_expires_ms": None,
        "due_ms": None,
        "admitted_ms": None,
    }
    return TaskWrite(values, (("task.waiting", task_document),))
