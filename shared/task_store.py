"""Every query on the tasks table: creation, lookup, leases, progress and final states.

Functions take a session and never commit: the caller owns the transaction. State changes
are conditional UPDATEs; those that can lose a race say whether they happened.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from types import SimpleNamespace
from typing import Any, NoReturn, cast

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    DateTime,
    Table,
    Update,
    bindparam,
    insert,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.orm import Session

from shared import batch, metrics, outbox
from shared.batch import Batch, Increment, Part
from shared.db import fetch_one, now_ms
from shared.errors import CancelRequested, Conflict, LeaseLost, NotFound
from shared.ids import new_id
from shared.models import Task, TaskEvent, TaskStatus, utcnow
from shared.views import TaskState, task_document

# A task row as a write returns it: every column, "metadata" under its attribute name.
TASK_COLUMNS = [c.label("meta") if c.name == "metadata" else c for c in Task.__table__.columns]


_TASKS = cast(Table, Task.__table__)
# The task as it is now, with the database clock: what a lease decides from.
_READ = select(*TASK_COLUMNS, now_ms().label("clock_ms")).where(
    _TASKS.c.id == bindparam("b_task_id")
)


def _lease_statement(*, queued: bool) -> Update:
    """The lease UPDATE, built once per case: it runs before every step.

    It is a compare-and-set on the row as read just before (epoch, event seq, status, step,
    and ``updated_at``, which every write of the columns a Task document shows sets), so
    what the lease predicts of the row (the ``task.started`` event carries it) is what the
    row became; a row changed in between refuses the lease, and the slow path says why.
    """
    c = _TASKS.c
    free = c.lease_expires_ms.is_(None) | (c.lease_expires_ms <= now_ms())
    now = bindparam("b_now", type_=DateTime(timezone=True))
    values: dict[str, Any] = {
        "lease_epoch": c.lease_epoch + 1,
        "lease_owner": bindparam("b_owner"),
        "lease_expires_ms": now_ms() + bindparam("b_ttl", type_=BigInteger),
        "attempt": c.attempt + 1,
        "status": TaskStatus.RUNNING,
        "updated_at": now,
    }
    if queued:  # this lease starts the task: it reserves the seq of ``task.started``
        values |= {"started_at": now, "last_event_seq": c.last_event_seq + 1}
    return (
        update(_TASKS)
        .where(c.id == bindparam("b_task_id"), c.lease_epoch == bindparam("b_epoch"))
        .where(c.last_event_seq == bindparam("b_seq"), c.status == bindparam("b_status"))
        .where(c.steps == bindparam("b_steps"), c.attempt < bindparam("b_max_attempts"), free)
        .where(c.updated_at == bindparam("b_updated_at", type_=DateTime(timezone=True)))
        .values(values)
        .returning(c.id, c.last_event_seq, now_ms().label("clock_ms"))
    )


_LEASE = {queued: _lease_statement(queued=queued) for queued in (True, False)}
_INSERT_EVENTS = insert(cast(Table, TaskEvent.__table__))  # Core: no ORM bookkeeping
FIELDS = [column.name for column in TASK_COLUMNS]  # a TaskState's attributes


def state_of(task: TaskState) -> SimpleNamespace:
    """A copy of ``task`` (an ORM Task, a row or a state) that ``predict`` may change."""
    return SimpleNamespace(**{name: getattr(task, name) for name in FIELDS})


def predict(task: TaskState, changes: dict[str, Any]) -> TaskState:
    """The row as a write of ``changes`` leaves it. Exact for a fenced write: only the lease
    holder changes the columns a Task document shows, and it knows the row it leased. Values
    on the database's clock stay ``FromNow`` until ``_settle`` puts the clock in."""
    state = state_of(task)
    for key, value in changes.items():
        if isinstance(value, Increment):
            setattr(state, key, getattr(state, key) + value.by)
        else:
            setattr(state, key, value)
    return cast(TaskState, state)


@dataclass(frozen=True)
class NewTask:
    agent: str
    model: str
    input: Any
    instructions: str | None
    tools: list[str]
    model_options: dict[str, Any]
    max_steps: int
    budget: dict[str, Any] | None
    webhook: dict[str, Any] | None
    metadata: dict[str, Any]
    deadline_seconds: float | None = None


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


@dataclass(frozen=True)
class LeaseRefused:
    """Why no lease: ``retry_in_ms`` > 0 means try again then; 0 means drop the message."""

    reason: str
    retry_in_ms: int = 0


def create_task(
    session: Session,
    tenant_id: str,
    spec: NewTask,
    *,
    idempotency_key: str | None = None,
    request_hash: str | None = None,
    deliveries: list[str] | None = None,
) -> Task:
    task = Task(
        id=new_id(),
        tenant_id=tenant_id,
        agent=spec.agent,
        model=spec.model,
        status=TaskStatus.QUEUED,
        input=spec.input,
        instructions=spec.instructions,
        tools=spec.tools,
        model_options=spec.model_options,
        max_steps=spec.max_steps,
        budget=spec.budget,
        webhook=spec.webhook,
        meta=spec.metadata,
        idempotency_key=idempotency_key,
        request_hash=request_hash,
        due_ms=now_ms(),
        deadline_ms=now_ms() + int(spec.deadline_seconds * 1000) if spec.deadline_seconds else None,
        last_event_seq=1,  # task.queued, logged below
    )
    session.add(task)
    session.flush()  # the row first: the event references it
    _insert_logged(session, task, "task.queued", deliveries)
    return task


def _log_event(session: Session, task: Task, type_: str, deliveries: list[str] | None) -> None:
    """Append one event outside a step (its seq reserved here), with its webhooks."""
    task.last_event_seq += 1
    session.flush()
    _insert_logged(session, task, type_, deliveries)


def _insert_logged(session: Session, task: Task, type_: str, deliveries: list[str] | None) -> None:
    """Insert the event whose seq the task row reserved last, with its webhooks."""
    queued = insert_events(
        session,
        [(type_, task_document)],
        task=task,
        subscriptions=outbox.subscriptions_for(session, task),
    )
    if deliveries is not None:
        deliveries.extend(queued)


def find_by_idempotency_key(session: Session, tenant_id: str, key: str) -> Task | None:
    return session.scalar(
        select(Task).where(Task.tenant_id == tenant_id, Task.idempotency_key == key)
    )


def get_task(session: Session, tenant_id: str, task_id: str) -> Task:
    """The tenant's task. Another tenant's task is indistinguishable from a missing one."""
    task = session.scalar(select(Task).where(Task.id == task_id, Task.tenant_id == tenant_id))
    if task is None:
        raise NotFound(f"no task {task_id}")
    return task


def encode_cursor(value: str) -> str:
    return base64.urlsafe_b64encode(value.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> str:
    """Strictly: anything this API did not hand out is a ValueError."""
    try:
        raw = base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_", validate=True)
        value = raw.decode()
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError("malformed cursor") from exc
    if not value or not value.isprintable():  # no cursor holds a NUL or control character
        raise ValueError("malformed cursor")
    return value


def list_tasks(
    session: Session,
    tenant_id: str,
    *,
    status: str | None = None,
    agent: str | None = None,
    limit: int = 50,
    after_id: str | None = None,
) -> tuple[Sequence[Task], str | None]:
    """A page of the tenant's tasks, newest first, and the id to continue after (or None)."""
    query = select(Task).where(Task.tenant_id == tenant_id)
    if status:
        query = query.where(Task.status == status)
    if agent:
        query = query.where(Task.agent == agent)
    if after_id:
        query = query.where(Task.id < after_id)
    rows = session.scalars(query.order_by(Task.id.desc()).limit(limit + 1)).all()
    more = len(rows) > limit
    return rows[:limit], (rows[limit - 1].id if more else None)


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
    read = fetch_one(session, _READ, {"b_task_id": task_id})
    refused = _refused_at_sight(read, step=step)
    if refused is not None:
        return refused
    assert read is not None
    if read.attempt >= max_attempts:  # perhaps poisoned: the careful path decides
        return _refusal(session, task_id, ttl_ms=ttl_ms, step=step, max_attempts=max_attempts)
    lease_batch, leased = _lease_batch(session, read, owner=owner, ttl_ms=ttl_ms)
    lease_batch.params["b_max_attempts"] = max_attempts
    row = batch.run(session, lease_batch)
    if row is None:
        return _refusal(session, task_id, ttl_ms=ttl_ms, step=step, max_attempts=max_attempts)
    _settle(leased, row)
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
        fresh=read.started_at is None,
        deliveries=tuple(d["id"] for d in lease_batch.deliveries),
        task=leased,
    )


def _lease_batch(
    session: Session, read: Any, *, owner: str, ttl_ms: int
) -> tuple[Batch, TaskState]:
    """The lease's compare-and-set on the row as ``read``, and the row it will leave; a lease
    that starts a queued task logs ``task.started`` with it."""
    queued, now = read.status == TaskStatus.QUEUED, utcnow()
    changes: dict[str, Any] = {
        "lease_epoch": read.lease_epoch + 1,
        "lease_owner": owner,
        "lease_expires_ms": FromNow(ttl_ms),
        "attempt": read.attempt + 1,
        "status": TaskStatus.RUNNING,
        "updated_at": now,
    }
    if queued:
        changes |= {"started_at": now, "last_event_seq": read.last_event_seq + 1}
    leased = predict(read, changes)
    params = {"b_task_id": read.id, "b_owner": owner, "b_ttl": ttl_ms, "b_now": now}
    params |= {"b_epoch": read.lease_epoch, "b_seq": read.last_event_seq, "b_status": read.status}
    params |= {"b_steps": read.steps, "b_updated_at": read.updated_at}
    # A lease that logs nothing commits without waiting for its WAL flush: lost in a database
    # crash, it is as if never taken, and whatever the worker then writes durably flushes it
    # first. One that starts the task waits: readers are woken to its task.started at once.
    lease_batch = Batch(
        fence=_LEASE[queued], key=("lease", queued), params=params, now=now, durable=queued
    )
    if queued:
        _log_in_batch(session, lease_batch, [("task.started", task_document)], task=leased)
    return lease_batch, leased


def _refused_at_sight(read: Any, *, step: int | None) -> LeaseRefused | None:
    """The refusals a read of the task decides (the common ones: stale and duplicate
    messages), or None."""
    if read is None:
        return LeaseRefused("missing")
    if read.status not in TaskStatus.RUNNABLE:
        return LeaseRefused(f"status is {read.status}")
    if step is not None and read.steps + 1 != step:
        return LeaseRefused(f"stale message for step {step}; task is at step {read.steps + 1}")
    if read.lease_expires_ms is not None and read.lease_expires_ms > read.clock_ms:
        return LeaseRefused(HELD, retry_in_ms=int(read.lease_expires_ms - read.clock_ms))
    return None


def _log_in_batch(
    session: Session, to: Batch, events: Sequence[EventSpec], *, task: TaskState
) -> None:
    """Add ``events`` (the last seqs the fence reserves) and their webhooks to a batch;
    ``task`` is the row as the fence leaves it, which events built from the task carry."""
    resolved = [(type_, spec(task) if callable(spec) else spec) for type_, spec in events]
    to.events, to.tenant_id = resolved, task.tenant_id
    subscriptions = outbox.subscriptions_for(session, task)
    if subscriptions:
        offsets = [(i, type_, data) for i, (type_, data) in enumerate(resolved, 1)]
        to.deliveries = outbox.delivery_rows(subscriptions, offsets, task_id=task.id)
        to.first_delay_ms = outbox.first_delay_ms()


def _settle(state: TaskState, row: Any) -> None:
    """Put what only the database knew (its clock, the event seq) into a predicted state."""
    fixed = cast(SimpleNamespace, state)
    fixed.last_event_seq = row.last_event_seq
    for key in ("lease_expires_ms", "due_ms"):
        if isinstance(getattr(fixed, key), FromNow):
            setattr(fixed, key, row.clock_ms + getattr(fixed, key).ms)


def _refusal(
    session: Session, task_id: str, *, ttl_ms: int, step: int | None, max_attempts: int
) -> LeaseRefused:
    """Why no lease, read afresh (the slow path): the task moved on, someone holds it, its
    step keeps killing its workers, or another worker won the race."""
    read = fetch_one(session, _READ, {"b_task_id": task_id})
    refused = _refused_at_sight(read, step=step)
    if refused is not None:
        return refused  # a live lease among them: whatever the attempt count, it is working
    assert read is not None
    if read.attempt >= max_attempts and _fail_poisoned(session, read, max_attempts):
        return LeaseRefused("poisoned: failed with worker_lost")
    return LeaseRefused("lost the race for the lease", retry_in_ms=ttl_ms)


HELD = "held by another worker"
CANCELLED_ERROR = {"type": "cancelled", "message": "cancelled at the client's request"}


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
        **_terminal(TaskStatus.FAILED, error=error),
        "last_event_seq": Increment(1),
        "lease_epoch": Increment(1),
    }
    shape = _shape(values)
    params = _params(values) | {"b_task_id": task.id, "b_epoch": task.lease_epoch}
    params |= {"b_seq": task.last_event_seq, "b_updated_at": task.updated_at}
    poison = Batch(
        fence=_poison_statement(shape), key=("poison", shape), params=params, now=utcnow()
    )
    failed = predict(task, values)
    _log_in_batch(session, poison, [("task.failed", task_document)], task=failed)
    if batch.run(session, poison) is None:
        return False
    metrics.tasks_finished.labels(status=TaskStatus.FAILED).inc()
    return True


@lru_cache(maxsize=4)
def _poison_statement(shape: tuple[tuple[str, str], ...]) -> Update:
    """A compare-and-set on the row as read (epoch, event seq, ``updated_at``), unleased."""
    c = _TASKS.c
    return (
        update(_TASKS)
        .where(c.id == bindparam("b_task_id"), c.lease_epoch == bindparam("b_epoch"))
        .where(c.last_event_seq == bindparam("b_seq"))
        .where(c.updated_at == bindparam("b_updated_at", type_=DateTime(timezone=True)))
        .where(_runnable(c.status))
        .where(c.lease_expires_ms.is_(None) | (c.lease_expires_ms <= now_ms()))
        .values(_assignments(shape))
        .returning(c.id, c.last_event_seq, now_ms().label("clock_ms"))
    )


def _held(lease: Lease) -> ColumnElement[bool]:
    return (
        (Task.id == lease.task_id)
        & (Task.lease_epoch == lease.epoch)
        & Task.status.in_(TaskStatus.RUNNABLE)
    )


EventSpec = tuple[str, dict[str, Any] | Callable[[TaskState], dict[str, Any]]]


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


@dataclass(frozen=True)
class FromNow:
    """A value for write(): the database clock plus ``ms`` (epoch milliseconds)."""

    ms: int


def _runnable(status: ColumnElement[str]) -> ColumnElement[bool]:
    """``status IN (…)`` spelled with OR: an IN list is expanded at each execution, which a
    statement compiled once (db.fetch_one) cannot have."""
    return or_(*(status == value for value in TaskStatus.RUNNABLE))


def _kind(value: Any) -> str:
    return "inc" if isinstance(value, Increment) else "now" if isinstance(value, FromNow) else "set"


def _param(value: Any) -> Any:
    if isinstance(value, Increment):
        return value.by
    return value.ms if isinstance(value, FromNow) else value


def _shape(changes: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((key, _kind(value)) for key, value in changes.items()))


def _params(changes: dict[str, Any]) -> dict[str, Any]:
    return {f"b_{key}": _param(value) for key, value in changes.items()}


def _assignments(shape: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """The SET clause of a write of this shape, its values bound as ``b_<column>``."""
    c = _TASKS.c
    changes: dict[str, Any] = {}
    for key, kind in shape:
        column = c[key]
        if kind == "inc":
            changes[key] = column + bindparam(f"b_{key}", type_=column.type)
        elif kind == "now":
            changes[key] = now_ms() + bindparam(f"b_{key}", type_=BigInteger)
        else:
            changes[key] = bindparam(f"b_{key}", type_=column.type)
    return changes


@lru_cache(maxsize=128)
def _write_statement(shape: tuple[tuple[str, str], ...], *, honour_cancel: bool) -> Update:
    """The fenced UPDATE for one shape of write, built once and reused with new parameters:
    every write of a step runs one, so building and keying it each time would dominate."""
    c = _TASKS.c
    condition = (c.id == bindparam("b_task_id")) & (c.lease_epoch == bindparam("b_epoch"))
    condition &= _runnable(c.status)
    if honour_cancel:
        condition &= c.cancel_requested_at.is_(None)
    return (
        update(_TASKS)
        .where(condition)
        .values(_assignments(shape))
        .returning(c.id, c.last_event_seq, now_ms().label("clock_ms"))
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
    values: dict[str, Any] | None = None,
    events: Sequence[EventSpec] = (),
    parts: Sequence[Part] = (),
    honour_cancel: bool = True,
) -> Written:
    """The one fenced write of a step: check the lease, extend it, apply ``values``, log
    ``events``, and write ``parts`` (checkpoint and ledger rows) — all or nothing.

    The fence is an UPDATE of the task row conditional on the lease epoch: only a holder of
    the current epoch can write, and a competing lease-taker waits on its row lock and then
    sees the bumped epoch. On PostgreSQL the whole write is one statement (see shared.batch).
    ``task`` is the row as this lease holder last left it. Raises LeaseLost if the epoch
    moved on, CancelRequested if the client asked to cancel (unless ``honour_cancel`` is False).
    """
    now = utcnow()
    changes: dict[str, Any] = {
        "lease_expires_ms": FromNow(lease.ttl_ms),
        "updated_at": now,
        "last_event_seq": Increment(len(events)),
        **(values or {}),
    }
    shape = _shape(changes)
    fenced = Batch(
        fence=_write_statement(shape, honour_cancel=honour_cancel),
        key=("write", shape, honour_cancel),
        params=_params(changes) | {"b_task_id": lease.task_id, "b_epoch": lease.epoch},
        parts=list(parts),
        now=now,
    )
    after = predict(task, changes)
    if events:
        _log_in_batch(session, fenced, events, task=after)
    row = batch.run(session, fenced)
    if row is None:
        _refuse(session, lease)
    _settle(after, row)
    if after.status in TaskStatus.TERMINAL:
        metrics.tasks_finished.labels(status=after.status).inc()
    return Written(after, [d["id"] for d in fenced.deliveries])


def _refuse(session: Session, lease: Lease) -> NoReturn:
    """Why a fenced write matched nothing: a requested cancel, else a lost lease."""
    cancel = session.scalar(select(Task.cancel_requested_at).where(_held(lease)))
    if cancel is not None:
        raise CancelRequested(f"task {lease.task_id}: cancellation requested")
    raise LeaseLost(f"task {lease.task_id}: lease epoch {lease.epoch} is no longer current")


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
            Task.status.in_(TaskStatus.RUNNABLE),
        )
        .values(lease_expires_ms=now_ms() + ttl_ms)
        .returning(Task.id, Task.lease_epoch, Task.cancel_requested_at)
        .execution_options(synchronize_session=False)
    ).all()
    return {(row.id, row.lease_epoch): row.cancel_requested_at is not None for row in rows}


def usage_values(*, input_tokens: int, output_tokens: int, cost_usd: float) -> dict[str, Any]:
    return {
        "input_tokens": Increment(input_tokens),
        "output_tokens": Increment(output_tokens),
        "cost_usd": Increment(cost_usd),
    }


def progress_values(lease: Lease, *, next_owner: str | None = None) -> dict[str, Any]:
    """``lease.step`` is done: free the task for the next step's message, or, with
    ``next_owner``, lease the next step to it in the same write (see :func:`next_lease`)."""
    values: dict[str, Any] = {
        "steps": lease.step,
        "attempt": 0,
        "model_failures": 0,
        "waiting": None,
        "lease_owner": None,
        "lease_expires_ms": None,
        "due_ms": FromNow(0),
    }
    if next_owner is not None:
        values |= {
            "lease_epoch": Increment(1),
            "lease_owner": next_owner,
            "lease_expires_ms": FromNow(lease.ttl_ms),
            "attempt": 1,
        }
    return values


def next_lease(lease: Lease, task: TaskState) -> Lease | None:
    """The lease on the next step that the write which left ``task`` took with the step's
    completion (``progress_values(next_owner=…)``), or None if it took none.

    It is a lease like any other: a new epoch, so everything the previous holder of the
    task might still write is fenced off; its expiry on the database's clock, so if this
    worker dies the sweeper finds the task once it runs out.
    """
    if task.lease_epoch != lease.epoch + 1 or task.status not in TaskStatus.RUNNABLE:
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
    )


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
    }
    if model_failures is not None:
        values["model_failures"] = model_failures
    return values


def _terminal(
    status: str, *, result: dict[str, Any] | None = None, error: dict[str, Any] | None = None
) -> dict[str, Any]:
    assert status in TaskStatus.TERMINAL
    return {
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
    }


def terminal_values(
    status: str,
    *,
    result: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    steps: int | None = None,
) -> dict[str, Any]:
    """The values that end a task (pair with its ``task.<status>`` event)."""
    values = _terminal(status, result=result, error=error)
    if steps is not None:
        values["steps"] = steps
    return values


def request_cancel(
    session: Session, tenant_id: str, task_id: str, *, deliveries: list[str] | None = None
) -> Task:
    """Cancel now if no worker holds the task; otherwise flag it for the next commit point."""
    task = get_task(session, tenant_id, task_id)
    if task.status in TaskStatus.TERMINAL:
        raise Conflict(f"task {task_id} is already {task.status}")
    clock = session.scalar(select(now_ms()))
    assert clock is not None
    idle = task.lease_expires_ms is None or task.lease_expires_ms <= clock
    if idle:
        done = session.execute(
            update(Task)
            .where(Task.id == task_id, Task.lease_epoch == task.lease_epoch)
            .where(Task.status.not_in(TaskStatus.TERMINAL))
            # the epoch moves on: a worker of an old lease that wakes up cannot write
            .values(
                {
                    **_terminal(TaskStatus.CANCELLED, error=CANCELLED_ERROR),
                    "lease_epoch": Task.lease_epoch + 1,
                }
            )
            .execution_options(synchronize_session=False)
        )
        if done.rowcount == 1:  # type: ignore[attr-defined]
            metrics.tasks_finished.labels(status=TaskStatus.CANCELLED).inc()
            session.refresh(task)
            _log_event(session, task, "task.cancelled", deliveries)
            return task
    session.execute(
        update(Task)
        .where(Task.id == task_id, Task.status.not_in(TaskStatus.TERMINAL))
        .values(cancel_requested_at=utcnow(), updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    session.refresh(task)
    return task


def requeue_failed(
    session: Session, tenant_id: str, task_id: str, *, deliveries: list[str] | None = None
) -> Task:
    """``failed → queued``: the task resumes from its last committed step."""
    task = get_task(session, tenant_id, task_id)
    done = session.execute(
        update(Task)
        .where(Task.id == task_id, Task.status == TaskStatus.FAILED)
        .values(
            lease_epoch=Task.lease_epoch + 1,  # a worker of an old lease cannot write any more
            status=TaskStatus.QUEUED,
            error=None,
            finished_at=None,
            attempt=0,
            model_failures=0,
            due_ms=now_ms(),
            updated_at=utcnow(),
        )
        .execution_options(synchronize_session=False)
    )
    if done.rowcount != 1:  # type: ignore[attr-defined]
        raise Conflict(f"only a failed task can be retried; task {task_id} is {task.status}")
    session.refresh(task)
    _log_event(session, task, "task.queued", deliveries)
    return task


def _overdue(
    clock: ColumnElement[int], *, grace_ms: int, sent_before_ms: int | None
) -> ColumnElement[bool]:
    """Runnable, no live lease, and its next step overdue: the step's message was lost. A
    task due since ``sent_before_ms`` (when the oldest message still waiting in the queue was
    sent, see the sweeper) is only behind a backlog: its message is still to come."""
    overdue = (
        Task.status.in_(TaskStatus.RUNNABLE)
        & (Task.due_ms < clock - grace_ms)
        & (Task.lease_expires_ms.is_(None) | (Task.lease_expires_ms < clock))
    )
    if sent_before_ms is not None:
        overdue &= Task.due_ms < sent_before_ms
    return overdue


def due_for_sweep(
    session: Session, *, grace_ms: int, sent_before_ms: int | None = None, limit: int = 500
) -> Sequence[tuple[str, int]]:
    """Runnable tasks with no live lease whose next step is overdue: their message was lost."""
    rows = session.execute(
        select(Task.id, Task.steps)
        .where(_overdue(now_ms(), grace_ms=grace_ms, sent_before_ms=sent_before_ms))
        .order_by(Task.due_ms)
        .limit(limit)
    ).all()
    return [(row.id, row.steps + 1) for row in rows]


def mark_redispatched(
    session: Session, task_ids: Sequence[str], *, grace_ms: int, sent_before_ms: int | None = None
) -> list[tuple[str, int]]:
    """Claim the overdue ones among ``task_ids`` for a new message (their due time moves to
    now), in one statement; returns (task, step) for each, for the caller to send. A task
    another sweeper claimed meanwhile is no longer overdue, so it gets one message."""
    if not task_ids:
        return []
    rows = session.execute(
        update(Task)
        .where(
            Task.id.in_(task_ids),
            _overdue(now_ms(), grace_ms=grace_ms, sent_before_ms=sent_before_ms),
        )
        .values(due_ms=now_ms())
        .returning(Task.id, Task.steps)
        .execution_options(synchronize_session=False)
    ).all()
    return [(row.id, row.steps + 1) for row in rows]
