"""Tasks outside a step: creation, lookup and listing, cancel and retry requests, admission
from the backlog, and the sweeper's queries for tasks whose message was lost."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Boolean,
    ColumnElement,
    Table,
    bindparam,
    case,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.orm import Session, make_transient_to_detached

from shared.errors import Conflict, NotFound
from shared.ids import new_id
from shared.observability import metrics
from shared.statuses import TERMINAL_STATUSES, TaskStatus, in_order
from shared.store import outbox
from shared.store.backends import run_batch, run_batches
from shared.store.batch import Batch
from shared.store.db import now_ms
from shared.store.events import insert_events
from shared.store.fenced import log_in_batch
from shared.store.forks import ForkPoint
from shared.store.step_write import CANCELLED_ERROR, terminal_values
from shared.store.tables import Task, runnable, utcnow
from shared.views import task_document


@dataclass(frozen=True)
class Logged:
    """A change to a task outside a step, as it left the row: the task, and the webhook
    deliveries its event queued in the outbox (to be sent once the caller commits)."""

    task: Task
    deliveries: list[str]


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
    approval: dict[str, Any] | None = None
    priority: int = 0
    run_at_ms: int | None = None  # not before then (epoch ms); None: at once
    schedule_id: str | None = None
    output_schema: dict[str, Any] | None = None  # the JSON Schema the final answer must meet
    context: dict[str, Any] | None = None  # the context-window policy (shared.context_window)
    # A fork (shared.store.forks): it starts after this step of that task, whose steps up to
    # there it holds as its own (copied in the same transaction).
    forked_from: ForkPoint | None = None
    agent_version: str | None = None  # the agent version it runs (shared.agents.versions)
    # A thread's turn: its thread, its number there, and whether it waits for an earlier one
    # (shared.store.threads).
    thread_id: str | None = None
    turn: int | None = None
    turn_held: bool = False
    stream: bool | None = None  # whether its model calls stream (None: the default)
    # A sub-agent's task: the parent whose call started it, that call, its tree's root and
    # its depth below it (shared.actions.families).
    parent_id: str | None = None
    parent_call_id: str | None = None
    root_id: str | None = None
    depth: int = 0
    batch_id: str | None = None  # the batch it is submitted in (shared.store.batches)


def create_task(
    session: Session,
    tenant_id: str,
    spec: NewTask,
    *,
    idempotency_key: str | None = None,
    request_hash: str | None = None,
    admitted: bool = False,
) -> Logged:
    """Insert a queued task: in the backlog, or (``admitted``, the direct path of
    ``shared.scheduling.gate``) admitted already, its message the caller's to send."""
    task, clock = _new_task(tenant_id, spec, idempotency_key, request_hash, admitted=admitted)
    batch = _insert_batch(session, task, clock)
    return _inserted(session, task, batch, run_batch(session, batch))


# A task to create: its spec, Idempotency-Key and request hash.
Creation = tuple[NewTask, str | None, str | None]


def create_tasks(session: Session, tenant_id: str, creations: Sequence[Creation]) -> list[Logged]:
    """Insert queued tasks in the backlog, in order, each as :func:`create_task` would, their
    statements all sent before the first answer is awaited (``backends.run_batches``): a
    batch of tasks costs one round trip, not one each."""
    new = [_new_task(tenant_id, *creation, admitted=False) for creation in creations]
    batches = [_insert_batch(session, task, clock) for task, clock in new]
    rows = run_batches(session, batches)
    return [
        _inserted(session, task, batch, row)
        for (task, _), batch, row in zip(new, batches, rows, strict=True)
    ]


def _new_task(
    tenant_id: str,
    spec: NewTask,
    idempotency_key: str | None,
    request_hash: str | None,
    *,
    admitted: bool,
) -> tuple[Task, dict[str, Any]]:
    """The task ``spec`` makes, and what its clock columns are made of (see _insert_batch)."""
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
        approval=spec.approval,
        idempotency_key=idempotency_key,
        request_hash=request_hash,
        priority=spec.priority,
        run_at=_at(spec.run_at_ms),
        schedule_id=spec.schedule_id,
        output_schema=spec.output_schema,
        context=spec.context,
        forked_from=spec.forked_from.as_json() if spec.forked_from else None,
        steps=spec.forked_from.step if spec.forked_from else 0,
        agent_version=spec.agent_version,
        thread_id=spec.thread_id,
        turn=spec.turn,
        turn_held=spec.turn_held,
        stream=spec.stream,
        parent_id=spec.parent_id,
        parent_call_id=spec.parent_call_id,
        root_id=spec.root_id,
        depth=spec.depth,
        batch_id=spec.batch_id,
        last_event_seq=1,  # task.queued, logged below
    )
    # It waits in the backlog until the dispatcher admits it (shared.scheduling): due now
    # (by the database's clock) unless it asked for later.
    deadline_in_ms = int(spec.deadline_seconds * 1000) if spec.deadline_seconds else None
    return task, {"due_at_ms": spec.run_at_ms, "admit": admitted, "deadline_in_ms": deadline_in_ms}


# Set by the database's clock as the row goes in (see _insert): read back, not sent.
_CLOCK_COLUMNS = ("due_ms", "admitted_ms", "deadline_ms")
_COLUMNS = [
    (column, Task.__mapper__.get_property_by_column(column).key)
    for column in Task.__table__.columns
    if column.key not in _CLOCK_COLUMNS
]
_inserts: dict[frozenset[str], Any] = {}


def _insert_batch(session: Session, task: Task, clock: dict[str, Any]) -> Batch:
    """The INSERT of a new task and its ``task.queued`` event (with its webhooks' outbox rows)
    as one batch (``shared.store.batch``): one statement on PostgreSQL, compiled once per set
    of columns, where the ORM's flush and a second INSERT cost a third of the API's CPU per
    submission. As the ORM would: the columns ``task`` has values for, and the defaults of
    those it has not (set on ``task`` too); the rest stay SQL NULL. The clock's columns come
    from the database: ``due_ms`` is ``due_at_ms`` or now, ``admitted_ms`` now if ``admit``,
    ``deadline_ms`` now + ``deadline_in_ms``."""
    state, values = task.__dict__, dict(clock)
    for column, attribute in _COLUMNS:
        if attribute not in state and column.default is not None:
            default = column.default.arg
            setattr(task, attribute, default(None) if callable(default) else default)
        if attribute in state:
            values[column.key] = state[attribute]
        else:
            setattr(task, attribute, None)
    shape = frozenset(values)
    statement = _inserts.get(shape)
    if statement is None:
        statement = _inserts[shape] = _insert_statement(values)
    batch = Batch(fence=statement, key=("create_task", shape), params=values, now=utcnow())
    log_in_batch(session, batch, [("task.queued", task_document)], task=task)
    return batch


def _inserted(session: Session, task: Task, batch: Batch, row: Any) -> Logged:
    """The task as its batch inserted it (``row``: what the database's clock set), joined to
    the session as if loaded, every attribute present (none loads again), with the webhook
    deliveries it queued."""
    assert row is not None  # an INSERT … RETURNING returns its row
    task.due_ms, task.admitted_ms, task.deadline_ms = row.due_ms, row.admitted_ms, row.deadline_ms
    make_transient_to_detached(task)
    session.add(task)
    return Logged(task, [d["id"] for d in batch.deliveries])


def _insert_statement(values: dict[str, Any]) -> Any:
    table = cast(Table, Task.__table__)
    plain = {key: bindparam(key, type_=table.c[key].type) for key in values if key in table.c}
    clock = {
        "due_ms": func.coalesce(bindparam("due_at_ms", type_=BigInteger), now_ms()),
        "admitted_ms": case((bindparam("admit", type_=Boolean), now_ms())),
        "deadline_ms": now_ms() + bindparam("deadline_in_ms", type_=BigInteger),
    }
    columns = (table.c[key] for key in ("id", "last_event_seq", *_CLOCK_COLUMNS))
    return insert(table).values(plain | clock).returning(*columns)


def _at(epoch_ms: int | None) -> datetime | None:
    return None if epoch_ms is None else datetime.fromtimestamp(epoch_ms / 1000, tz=UTC)


def _log_event(session: Session, task: Task, type_: str) -> Logged:
    """Append one event outside a step (its seq reserved here), with its webhooks."""
    task.last_event_seq += 1
    session.flush()
    queued = insert_events(
        session,
        [(type_, task_document)],
        task=task,
        subscriptions=outbox.subscriptions_for(session, task),
    )
    return Logged(task, queued)


def find_by_idempotency_key(session: Session, tenant_id: str, key: str) -> Task | None:
    return session.scalar(
        select(Task).where(Task.tenant_id == tenant_id, Task.idempotency_key == key)
    )


def find_by_idempotency_keys(
    session: Session, tenant_id: str, keys: Sequence[str]
) -> dict[str, Task]:
    """The tenant's tasks submitted with any of ``keys``, by key: one query for a batch."""
    if not keys:
        return {}
    found = session.scalars(
        select(Task).where(Task.tenant_id == tenant_id, Task.idempotency_key.in_(keys))
    )
    return {task.idempotency_key: task for task in found if task.idempotency_key is not None}


def get_task(session: Session, tenant_id: str, task_id: str) -> Task:
    """The tenant's task. Another tenant's task is indistinguishable from a missing one."""
    task = session.scalar(select(Task).where(Task.id == task_id, Task.tenant_id == tenant_id))
    if task is None:
        raise NotFound(f"no task {task_id}")
    return task


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


def request_cancel(session: Session, tenant_id: str, task_id: str) -> Logged:
    """Cancel now if no worker holds the task; otherwise flag it for the worker holding it,
    which the API wakes (see workers.cancels) to stop its step and cancel the task."""
    task = get_task(session, tenant_id, task_id)
    if task.status in TERMINAL_STATUSES:
        raise Conflict(f"task {task_id} is already {task.status}")
    clock = session.scalar(select(now_ms()))
    assert clock is not None
    idle = task.lease_expires_ms is None or task.lease_expires_ms <= clock
    if idle:
        done = session.execute(
            update(Task)
            .where(Task.id == task_id, Task.lease_epoch == task.lease_epoch)
            .where(Task.status.not_in(in_order(TERMINAL_STATUSES)))
            # the epoch moves on: a worker of an old lease that wakes up cannot write
            .values(
                {
                    **terminal_values(TaskStatus.CANCELLED, error=CANCELLED_ERROR),
                    "lease_epoch": Task.lease_epoch + 1,
                }
            )
            .execution_options(synchronize_session=False)
        )
        if done.rowcount == 1:  # type: ignore[attr-defined]
            metrics.tasks_finished.labels(status=TaskStatus.CANCELLED).inc()
            session.refresh(task)
            return _log_event(session, task, "task.cancelled")
    session.execute(
        update(Task)
        .where(Task.id == task_id, Task.status.not_in(in_order(TERMINAL_STATUSES)))
        .values(cancel_requested_at=utcnow(), updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    session.refresh(task)
    return Logged(task, [])


def requeue_failed(session: Session, tenant_id: str, task_id: str) -> Logged:
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
            admitted_ms=None,  # back in the backlog: the dispatcher admits it
            updated_at=utcnow(),
        )
        .execution_options(synchronize_session=False)
    )
    if done.rowcount != 1:  # type: ignore[attr-defined]
        raise Conflict(f"only a failed task can be retried; task {task_id} is {task.status}")
    session.refresh(task)
    return _log_event(session, task, "task.queued")


def lock_task(session: Session, task_id: str, tenant_id: str | None) -> Task:
    """The task, its row locked till the transaction ends (``tenant_id`` None: whichever
    tenant's): an UPDATE that changes nothing, so on SQLite the transaction is the writer
    before it reads anything. NotFound if there is no such task."""
    query = update(Task).where(Task.id == task_id)
    if tenant_id is not None:
        query = query.where(Task.tenant_id == tenant_id)
    locked = session.execute(query.values(updated_at=Task.updated_at))
    if locked.rowcount != 1:  # type: ignore[attr-defined]
        raise NotFound(f"no task {task_id}")
    task = session.get(Task, task_id, populate_existing=True)
    assert task is not None
    return task


def record_decision(
    session: Session, task: Task, call: dict[str, Any], *, pending: dict[str, Any] | None
) -> list[str]:
    """A person's (or the deadline's) decision on a call ``task`` waits for, logged as
    ``step.tool_call`` (``call``); the task locked first (:func:`lock_task`). ``pending``:
    what still waits (``pending_approval``), or None when this was the step's last: then the
    task runs again, back in the backlog for the dispatcher to admit its next step. Returns
    the webhook deliveries its event queued."""
    if pending is None:
        task.status, task.pending_approval, task.due_ms = TaskStatus.RUNNING, None, now_ms()
        task.admitted_ms = None
    else:
        task.pending_approval = pending
    task.updated_at = utcnow()
    return _log_locked(session, task, "step.tool_call", call)


def record_wait_settled(
    session: Session, task: Task, settled: dict[str, Any], *, resume: bool
) -> list[str]:
    """A wait of ``task`` (``waiting``, locked first: :func:`lock_task`) was settled, logged as
    ``wait.settled``; with ``resume`` (none of its waits is pending any more) the task runs
    again, back in the backlog for the dispatcher to admit the step that commits the calls'
    outcomes. Returns the webhook deliveries its event queued."""
    if resume:
        resume_waiting(session, task)
    task.updated_at = utcnow()
    return _log_locked(session, task, "wait.settled", settled)


def resume_waiting(session: Session, task: Task) -> None:
    """``waiting → running``: none of the task's waits is pending; back in the backlog."""
    task.status, task.due_ms, task.admitted_ms = TaskStatus.RUNNING, now_ms(), None
    task.waiting, task.updated_at = None, utcnow()
    session.flush()


def fail_awaiting(session: Session, task: Task, error: dict[str, Any]) -> list[str]:
    """End a task that waits for a decision (locked first: :func:`lock_task`) as failed
    with ``error``. The epoch moves on, so no worker of an old lease can write. Returns the
    webhook deliveries its ``task.failed`` queued."""
    for key, value in terminal_values(TaskStatus.FAILED, error=error).items():
        setattr(task, key, value)
    task.lease_epoch += 1
    deliveries = _log_locked(session, task, "task.failed", task_document)
    metrics.tasks_finished.labels(status=TaskStatus.FAILED).inc()
    return deliveries


def _log_locked(session: Session, task: Task, type_: str, data: Any) -> list[str]:
    """Write the locked task's changes with one event (its seq reserved with them), read
    the row back as written, and log the event with its webhooks."""
    task.last_event_seq += 1
    session.flush()
    session.refresh(task)
    return insert_events(
        session, [(type_, data)], task=task, subscriptions=outbox.subscriptions_for(session, task)
    )


def admit_waiting(session: Session, task_ids: Sequence[str]) -> list[tuple[str, int]]:
    """Admit those of ``task_ids`` still waiting in the backlog (runnable, not admitted):
    each due now and holding its slots, in one statement; (task, step) for each admitted,
    for the caller to send once committed. One admitted meanwhile (by another dispatcher, in
    a failover) is not admitted twice."""
    if not task_ids:
        return []
    rows = session.execute(
        update(Task)
        .where(Task.id.in_(task_ids), Task.admitted_ms.is_(None), runnable())
        .values(admitted_ms=now_ms(), due_ms=now_ms())
        .returning(Task.id, Task.steps)
        .execution_options(synchronize_session=False)
    ).all()
    return [(row.id, row.steps + 1) for row in rows]


def _overdue(
    clock: ColumnElement[int], *, grace_ms: int, sent_before_ms: int | None
) -> ColumnElement[bool]:
    """Runnable, no live lease, and its next step overdue: the step's message was lost. A
    task due since ``sent_before_ms`` (when the oldest message still waiting in the queue was
    sent, see the sweeper) is only behind a backlog: its message is still to come."""
    overdue = (
        runnable()
        & Task.admitted_ms.is_not(None)  # the backlog's tasks have no message: not lost
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


def ended_among(session: Session, task_ids: Sequence[str]) -> list[str]:
    """Those of ``task_ids`` that ended (a terminal status) or do not exist: the tasks whose
    scratch files nothing will read again."""
    if not task_ids:
        return []
    live = set(
        session.scalars(
            select(Task.id).where(
                Task.id.in_(task_ids), Task.status.not_in(in_order(TERMINAL_STATUSES))
            )
        )
    )
    return [task_id for task_id in task_ids if task_id not in live]
