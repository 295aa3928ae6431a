"""What a client (or the dashboard) can do to a task: submit it, cancel it, retry it.

Each is one transaction that returns the task as it left it and the ``Effects`` to send once
it has committed (``effects.after_commit``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.actions import waits
from shared.actions.effects import NONE, Effects, of_task
from shared.agents import versions
from shared.errors import Conflict, IdempotencyMismatch
from shared.scheduling import caps, concurrency, gate
from shared.statuses import TaskStatus
from shared.store import tasks
from shared.store import waits as pending_waits
from shared.store.backends import commit_each_statement
from shared.store.db import get_sessionmaker
from shared.store.tables import Task
from shared.store.tasks import NewTask


@dataclass(frozen=True)
class Submitted:
    """A submission's outcome: the task, whether this request created it (else it answers a
    repeat of an earlier request with the same Idempotency-Key), and what to send once
    committed (nothing for a repeat)."""

    task: Task
    created: bool
    effects: Effects = NONE
    # A thread's message that answered the question its turn in flight asked (``ask_user``):
    # no new turn; ``task`` is that turn, which runs on.
    answered: bool = False

    @property
    def replayed(self) -> bool:
        """Whether this answers a repeat of an earlier request (the task its Idempotency-Key
        made): nothing was made or answered this time."""
        return not self.created and not self.answered


def submit(
    tenant_id: str,
    tenant_name: str,
    spec: NewTask,
    *,
    idempotency_key: str | None,
    request_hash: str,
) -> Submitted:
    """Insert ``spec`` as the tenant's queued task, or, for a known Idempotency-Key, find the
    original (as ``submit_once``). Over the tenant's queue cap, refused (``caps.check``).

    One session, and (an uncapped tenant, no key) one statement in autocommit: this is the
    API's hot path."""

    def insert(session: Session, slot: DirectSlot) -> Submitted:
        if idempotency_key is None and caps.known_uncapped(tenant_name):
            # It counts and locks nothing, and its one write (the task, its event and their
            # webhooks) is one statement: no BEGIN and COMMIT round trips. (Without a key,
            # nothing has been read yet: this comes before the session's first statement.)
            commit_each_statement(session)
        caps.check(session, tenant_id, tenant_name)
        if spec.agent_version is not None:  # its row, once per process and version
            versions.record(session, spec.agent_version)
        admitted = slot.take(session, tenant_name, spec)
        logged = tasks.create_task(
            session,
            tenant_id,
            spec,
            idempotency_key=idempotency_key,
            request_hash=request_hash,
            admitted=admitted,
        )
        return Submitted(logged.task, created=True, effects=_submitted(logged, admitted))

    with get_sessionmaker()() as session:
        return submit_once(
            session,
            tenant_id,
            idempotency_key=idempotency_key,
            request_hash=request_hash,
            insert=insert,
        )


def submit_once(
    session: Session,
    tenant_id: str,
    *,
    idempotency_key: str | None,
    request_hash: str,
    insert: Callable[[Session, DirectSlot], Submitted],
) -> Submitted:
    """The task ``insert`` makes (a submission, a turn or a fork), in one transaction; or, when
    the tenant has a task with ``idempotency_key`` already, that one, replayed
    (IdempotencyMismatch if it was made from a different body). The unique index decides a
    race between two requests with one key: the one that loses answers with the original
    too, or Conflict while the request holding the key has not committed. Without a key,
    ``insert`` runs before any statement of the transaction. A gate slot ``insert`` took is
    landed once the transaction has committed or failed."""
    slot = DirectSlot()
    try:
        with session.begin():
            existing = idempotency_key and tasks.find_by_idempotency_key(
                session, tenant_id, idempotency_key
            )
            if existing:
                return Submitted(replay(existing, request_hash), created=False)
            return insert(session, slot)
    except IntegrityError:
        # A concurrent request with the same key committed first.
        if idempotency_key is None:
            raise
        with session.begin():
            existing = tasks.find_by_idempotency_key(session, tenant_id, idempotency_key)
        if existing is None:
            raise Conflict("a request with this Idempotency-Key is in progress") from None
        return Submitted(replay(existing, request_hash), created=False)
    finally:
        if slot.taken:  # the slot it took from the gate: committed, or not at all
            gate.land_slot()


def _submitted(logged: tasks.Logged, admitted: bool) -> Effects:
    """A new task's readers and webhooks, and its first step sent (``admitted``, the direct
    path) or the dispatcher woken to admit it."""
    task_id = logged.task.id
    effects = of_task(task_id, logged.deliveries, wake=not admitted)
    return effects + Effects(steps=((task_id, 1),)) if admitted else effects


def replay(existing: Task, request_hash: str) -> Task:
    """The task an Idempotency-Key found, if it was made from the same body (a submission,
    a turn or a fork); IdempotencyMismatch otherwise."""
    if existing.request_hash != request_hash:
        raise IdempotencyMismatch
    return existing


class DirectSlot:
    """The gate slot a submission may take to skip the backlog: at most one, taken inside its
    transaction and landed (``gate.land_slot``) once that transaction has ended."""

    def __init__(self) -> None:
        self.taken = False

    def take(self, session: Session, tenant: str, spec: NewTask) -> bool:
        """Whether the task skips the backlog (``direct``)."""
        self.taken = direct(session, tenant, spec)
        return self.taken


def direct(session: Session, tenant: str, spec: NewTask) -> bool:
    """Whether the task skips the backlog (``shared.scheduling.gate``): due now, under no
    concurrency limit (only the dispatcher counts slots), and a slot taken from the gate."""
    if spec.run_at_ms is not None:
        return False
    if concurrency.cached(session).governs(tenant=tenant, agent=spec.agent, model=spec.model):
        return False
    return gate.take_slot()


def cancel(session: Session, tenant_id: str, task_id: str) -> tuple[Task, Effects]:
    """Cancel now if no worker holds the task, else flag it and stop the step in flight
    (NotFound, or Conflict once it has ended)."""
    with session.begin():
        logged = tasks.request_cancel(session, tenant_id, task_id)
        if logged.task.status == TaskStatus.CANCELLED:  # parked, or queued: cancelled now
            pending_waits.cancel_pending(session, [task_id])
    task = logged.task
    effects = of_task(task.id, logged.deliveries)
    if task.cancel_requested_at is not None:  # a step is in flight: stop its wait
        effects += Effects(cancels=(task.id,))
    # What it started goes with it (a task that never ran a sub-agent has nothing below it).
    effects += waits.cancel_tree(session, tenant_id, task_id)
    return task, effects


def retry(session: Session, tenant_id: str, task_id: str) -> tuple[Task, Effects]:
    """``failed → queued``: back in the backlog, to resume from its last committed step
    (NotFound, or Conflict unless it failed); the dispatcher is woken to admit it."""
    try:
        with session.begin():
            logged = tasks.requeue_failed(session, tenant_id, task_id)
    except IntegrityError as exc:  # uq_tasks_thread_running: one turn of a thread at a time
        raise Conflict(
            f"task {task_id} is a thread's turn, and a later turn of its thread is unfinished"
        ) from exc
    return logged.task, of_task(logged.task.id, logged.deliveries, wake=True)
