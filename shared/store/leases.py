"""The lease protocol: taking a task's lease for its next step, extending the leases held,
the lease a step's completion takes on the next one, and failing a task whose step keeps
killing its workers."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any

from sqlalchemy import DateTime, Update, bindparam, select, tuple_, update
from sqlalchemy.orm import Session

from shared.observability import metrics
from shared.statuses import RUNNABLE_STATUSES, TaskStatus, in_order
from shared.store.backends import fetch_one, run_batch
from shared.store.batch import Batch, Increment
from shared.store.db import now_ms
from shared.store.fenced import (
    TASK_COLUMNS,
    TASKS,
    FromNow,
    assignments,
    log_in_batch,
    params_of,
    predict,
    runnable,
    settle,
    shape_of,
)
from shared.store.step_write import terminal_values
from shared.store.tables import Task, utcnow
from shared.views import TaskState, task_document

# The task as it is now, with the database clock: what a lease decides from.
READ_TASK = select(*TASK_COLUMNS, now_ms().label("clock_ms")).where(
    TASKS.c.id == bindparam("b_task_id")
)


def _lease_changes(*, owner: str, ttl_ms: int, now: datetime, queued: bool) -> dict[str, Any]:
    """What a lease writes: the one description from which both its SET clause and its
    prediction of the row come. A lease that starts a queued task reserves the seq of
    ``task.started``."""
    changes: dict[str, Any] = {
        "lease_epoch": Increment(1),
        "lease_owner": owner,
        "lease_expires_ms": FromNow(ttl_ms),
        "attempt": Increment(1),
        "status": TaskStatus.RUNNING,
        "updated_at": now,
    }
    if queued:
        changes |= {"started_at": now, "last_event_seq": Increment(1)}
    return changes


@lru_cache(maxsize=4)
def _lease_statement(shape: tuple[tuple[str, str], ...]) -> Update:
    """The lease UPDATE of a shape (two: starting a task or not): it runs before every step.

    It is a compare-and-set on the row as read just before (epoch, event seq, status, step,
    and ``updated_at``, which every write of the columns a Task document shows sets), so
    what the lease predicts of the row (the ``task.started`` event carries it) is what the
    row became; a row changed in between refuses the lease, and the slow path says why.
    """
    c = TASKS.c
    free = c.lease_expires_ms.is_(None) | (c.lease_expires_ms <= now_ms())
    return (
        update(TASKS)
        .where(c.id == bindparam("b_task_id"), c.lease_epoch == bindparam("w_epoch"))
        .where(c.last_event_seq == bindparam("w_seq"), c.status == bindparam("w_status"))
        .where(c.steps == bindparam("w_steps"), c.attempt < bindparam("w_max_attempts"), free)
        .where(c.updated_at == bindparam("w_updated_at", type_=DateTime(timezone=True)))
        .values(assignments(shape))
        .returning(c.id, c.last_event_seq, now_ms().label("clock_ms"))
    )


HELD = "held by another worker"


@dataclass(frozen=True)
class Lease:
    """Proof that this worker may write the task's next step, for as long as the epoch holds."""

    task_id: str
    epoch: int
    owner: str
    step: int
    attempt: int
    ttl_ms: int
    tenant_id: str = ""
    clock_ms: int = 0  # the database clock when the lease was taken
    started: bool = False  # this lease started the task (and logged task.started)
    fresh: bool = False  # the task never ran before: no step or ledger row to resume
    deliveries: tuple[str, ...] = ()  # webhook deliveries queued by that event
    task: TaskState | None = field(default=None, compare=False, repr=False)  # as leased
    # This process's monotonic clock just before the statement that took the lease went out:
    # the lease runs out ``ttl_ms`` after it at the latest (``workers.heartbeat.holding``).
    taken_at: float = field(default_factory=time.monotonic, compare=False, repr=False)


@dataclass(frozen=True)
class LeaseRefused:
    """Why no lease: ``retry_in_ms`` > 0 means try again then; 0 means drop the message."""

    reason: str
    retry_in_ms: int = 0


def take_lease(
    session: Session,
    task_id: str,
    *,
    owner: str,
    ttl_ms: int,
    step: int | None,
    max_attempts: int,
) -> Lease | LeaseRefused:
    """Take the task's lease for its next step, bumping ``lease_epoch`` and ``attempt``.

    A message for a step that is already committed is stale and refused for good; a lease
    held by someone else is refused with the time it has left. A step that has already been
    attempted ``max_attempts`` times without committing (its workers keep dying) fails the
    task with ``worker_lost`` instead of looping forever. A lease that starts a queued task
    logs ``task.started`` (and queues its webhooks) in the same statement.

    Two round trips: a read, then one compare-and-set UPDATE with its event and deliveries.
    """
    taken_at = time.monotonic()  # before the transaction's clock starts
    read = fetch_one(session, READ_TASK, {"b_task_id": task_id})
    refused = _refused_at_sight(read, step=step)
    if refused is not None:
        return refused
    assert read is not None
    if read.attempt >= max_attempts:  # perhaps poisoned: the careful path decides
        return _refusal(session, task_id, ttl_ms=ttl_ms, step=step, max_attempts=max_attempts)
    lease_batch, leased = _lease_batch(session, read, owner=owner, ttl_ms=ttl_ms)
    lease_batch.params["w_max_attempts"] = max_attempts
    row = run_batch(session, lease_batch)
    if row is None:
        return _refusal(session, task_id, ttl_ms=ttl_ms, step=step, max_attempts=max_attempts)
    settle(leased, row)
    return Lease(
        task_id=task_id,
        epoch=leased.lease_epoch,
        owner=owner,
        step=leased.steps + 1,
        attempt=leased.attempt,
        ttl_ms=ttl_ms,
        tenant_id=leased.tenant_id,
        clock_ms=int(row.clock_ms),
        started=bool(lease_batch.events),
        # A fork (shared.store.forks) never ran either, but holds the steps it inherited.
        fresh=read.started_at is None and read.steps == 0,
        deliveries=tuple(d["id"] for d in lease_batch.deliveries),
        task=leased,
        taken_at=taken_at,
    )


def _lease_batch(
    session: Session, read: Any, *, owner: str, ttl_ms: int
) -> tuple[Batch, TaskState]:
    """The lease's compare-and-set on the row as ``read``, and the row it will leave; a lease
    that starts a queued task logs ``task.started`` with it."""
    queued, now = read.status == TaskStatus.QUEUED, utcnow()
    changes = _lease_changes(owner=owner, ttl_ms=ttl_ms, now=now, queued=queued)
    leased = predict(read, changes)
    shape = shape_of(changes)
    params = params_of(changes) | {"b_task_id": read.id, "w_epoch": read.lease_epoch}
    params |= {"w_seq": read.last_event_seq, "w_status": read.status, "w_steps": read.steps}
    params |= {"w_updated_at": read.updated_at}
    # A lease that logs nothing commits without waiting for its WAL flush: lost in a database
    # crash, it is as if never taken, and whatever the worker then writes durably flushes it
    # first. One that starts the task waits: readers are woken to its task.started at once.
    lease_batch = Batch(
        fence=_lease_statement(shape), key=("lease", shape), params=params, now=now, durable=queued
    )
    if queued:
        log_in_batch(session, lease_batch, [("task.started", task_document)], task=leased)
    return lease_batch, leased


def _refused_at_sight(read: Any, *, step: int | None) -> LeaseRefused | None:
    """The refusals a read of the task decides (the common ones: stale and duplicate
    messages), or None."""
    if read is None:
        return LeaseRefused("missing")
    if read.status not in RUNNABLE_STATUSES:
        return LeaseRefused(f"status is {read.status}")
    if read.turn_held:  # released by the dispatcher, which then sends a message of its own
        return LeaseRefused("a thread's turn waiting for the turn before it to end")
    if step is not None and read.steps + 1 != step:
        return LeaseRefused(f"stale message for step {step}; task is at step {read.steps + 1}")
    if read.lease_expires_ms is not None and read.lease_expires_ms > read.clock_ms:
        return LeaseRefused(HELD, retry_in_ms=int(read.lease_expires_ms - read.clock_ms))
    return None


def _refusal(
    session: Session, task_id: str, *, ttl_ms: int, step: int | None, max_attempts: int
) -> LeaseRefused:
    """Why no lease, read afresh (the slow path): the task moved on, someone holds it, its
    step keeps killing its workers, or another worker won the race."""
    read = fetch_one(session, READ_TASK, {"b_task_id": task_id})
    refused = _refused_at_sight(read, step=step)
    if refused is not None:
        return refused  # a live lease among them: whatever the attempt count, it is working
    assert read is not None
    if read.attempt >= max_attempts and _fail_poisoned(session, read, max_attempts):
        return LeaseRefused("poisoned: failed with worker_lost")
    return LeaseRefused("lost the race for the lease", retry_in_ms=ttl_ms)


def _fail_poisoned(session: Session, task: TaskState, max_attempts: int) -> bool:
    """Fail a task whose step keeps killing its workers; only if nobody holds it and nothing
    wrote it since it was read. Returns whether it did. The epoch moves on, so a worker of an
    old lease that wakes up cannot write. Its webhooks go out with the sweeper's next pass."""
    error = {
        "type": "worker_lost",
        "message": f"step {task.steps + 1} was started {task.attempt} times and never finished "
        f"(its worker died each time); giving up after {max_attempts} attempts",
    }
    values = {
        **terminal_values(TaskStatus.FAILED, error=error),
        "last_event_seq": Increment(1),
        "lease_epoch": Increment(1),
    }
    shape = shape_of(values)
    params = params_of(values) | {"b_task_id": task.id, "w_epoch": task.lease_epoch}
    params |= {"w_seq": task.last_event_seq, "w_updated_at": task.updated_at}
    poison = Batch(
        fence=_poison_statement(shape), key=("poison", shape), params=params, now=utcnow()
    )
    failed = predict(task, values)
    log_in_batch(session, poison, [("task.failed", task_document)], task=failed)
    if run_batch(session, poison) is None:
        return False
    metrics.tasks_finished.labels(status=TaskStatus.FAILED).inc()
    return True


@lru_cache(maxsize=4)
def _poison_statement(shape: tuple[tuple[str, str], ...]) -> Update:
    """A compare-and-set on the row as read (epoch, event seq, ``updated_at``), unleased. The
    row as read is bound as ``w_*``; the values written, as every write's, as ``b_*``."""
    c = TASKS.c
    return (
        update(TASKS)
        .where(c.id == bindparam("b_task_id"), c.lease_epoch == bindparam("w_epoch"))
        .where(c.last_event_seq == bindparam("w_seq"))
        .where(c.updated_at == bindparam("w_updated_at", type_=DateTime(timezone=True)))
        .where(runnable(c.status))
        .where(c.lease_expires_ms.is_(None) | (c.lease_expires_ms <= now_ms()))
        .values(assignments(shape))
        .returning(c.id, c.last_event_seq, now_ms().label("clock_ms"))
    )


def extend_leases(
    session: Session, leases: Sequence[Lease], *, ttl_ms: int
) -> dict[tuple[str, int], bool]:
    """The heartbeat of many leases in one statement: extend each one still held by ``ttl_ms``;
    returns (task id, epoch) of each lease extended (any other was lost), and whether a cancel
    of its task was requested."""
    if not leases:
        return {}
    pairs = [(lease.task_id, lease.epoch) for lease in leases]
    rows = session.execute(
        update(Task)
        .where(
            tuple_(Task.id, Task.lease_epoch).in_(pairs),
            Task.status.in_(in_order(RUNNABLE_STATUSES)),
        )
        .values(lease_expires_ms=now_ms() + ttl_ms)
        .returning(Task.id, Task.lease_epoch, Task.cancel_requested_at)
        .execution_options(synchronize_session=False)
    ).all()
    return {(row.id, row.lease_epoch): row.cancel_requested_at is not None for row in rows}


def next_lease(lease: Lease, task: TaskState, *, taken_at: float | None = None) -> Lease | None:
    """The lease on the next step that the write which left ``task`` took with the step's
    completion (``progress_values(next_owner=…)``), or None if it took none.

    It is a lease like any other: a new epoch, so everything the previous holder of the
    task might still write is fenced off; its expiry on the database's clock, so if this
    worker dies the sweeper finds the task once it runs out. ``taken_at``: this process's
    monotonic clock just before that write went out (default: now).
    """
    if task.lease_epoch != lease.epoch + 1 or task.status not in RUNNABLE_STATUSES:
        return None
    assert task.lease_expires_ms is not None
    assert task.lease_owner is not None
    return Lease(
        task_id=lease.task_id,
        epoch=task.lease_epoch,
        owner=task.lease_owner,
        step=lease.step + 1,
        attempt=1,
        ttl_ms=lease.ttl_ms,
        tenant_id=lease.tenant_id,
        clock_ms=task.lease_expires_ms - lease.ttl_ms,
        task=task,
        taken_at=time.monotonic() if taken_at is None else taken_at,
    )
