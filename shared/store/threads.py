"""Threads: conversations whose turns are tasks.

A turn is an ordinary task with ``thread_id`` and ``turn`` (its number, from 1). The thread's
history is what its earlier turns committed — each one's input, then its completed steps and
their tool calls' outcomes, in order — read from their rows, never copied. A turn cancelled
by a ``rollback`` is ``rolled_back``: it leaves the history, its rows stay for audit. A fork
(``forked_from``, ``fork_turn``) reads its source's turns up to ``fork_turn`` as the start of
its own history, and numbers its own turns after them.

One turn of a thread runs at a time. A turn sent while another is unfinished is inserted
``turn_held``, with no due time, so the dispatcher never admits it (it admits only what is
due) and no lease is taken on it (``leases``). Once every earlier turn has ended, the
dispatcher's round releases the oldest held turn (:func:`release_held`): due now, in the
backlog like any task. The partial unique index ``uq_tasks_thread_running`` holds at most one
turn of a thread that is unfinished and not held, so no bug here can run two at once. All of
it is rows: a crash anywhere leaves the next round to release what is due.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import (
    ColumnElement,
    Select,
    Table,
    Update,
    and_,
    bindparam,
    exists,
    func,
    select,
    text,
    update,
)
from sqlalchemy.orm import Session

from shared.errors import NotFound
from shared.ids import new_id
from shared.statuses import TERMINAL_STATUSES, TaskStatus, in_order
from shared.store.db import now_ms
from shared.store.tables import Step, Task, Thread, ToolCall, utcnow

# The thread's status as its latest turn leaves it (no turn yet: idle).
IDLE, BUSY, ERROR = "idle", "busy", "error"
_STATUS_OF_TURN: dict[str, str] = {
    TaskStatus.QUEUED: BUSY,
    TaskStatus.RUNNING: BUSY,
    TaskStatus.AWAITING_APPROVAL: "awaiting_approval",
    TaskStatus.WAITING: "waiting",
    TaskStatus.FAILED: ERROR,
    TaskStatus.SUCCEEDED: IDLE,
    TaskStatus.CANCELLED: IDLE,
}


def thread_status(latest: Task | None) -> str:
    """``idle``, ``busy``, ``awaiting_approval``, ``waiting`` or ``error``, from the latest
    turn (a held one is queued: the thread is busy)."""
    return IDLE if latest is None else _STATUS_OF_TURN.get(latest.status, BUSY)


def create_thread(
    session: Session, tenant_id: str, *, agent: str, metadata: dict[str, Any]
) -> Thread:
    now = utcnow()
    thread = Thread(
        id=new_id(),
        tenant_id=tenant_id,
        agent=agent,
        meta=metadata,
        turns=0,
        created_at=now,
        updated_at=now,
    )
    session.add(thread)
    session.flush()
    return thread


def get_thread(session: Session, tenant_id: str, thread_id: str) -> Thread:
    """The tenant's thread; another tenant's is indistinguishable from a missing one."""
    thread = session.scalar(
        select(Thread).where(Thread.id == thread_id, Thread.tenant_id == tenant_id)
    )
    if thread is None:
        raise NotFound(f"no thread {thread_id}")
    return thread


def take_turn_number(session: Session, tenant_id: str, thread_id: str) -> int:
    """The thread's next turn number, its row locked till the transaction ends (NotFound for
    another tenant's thread). Turns sent at once to one thread queue here, one by one."""
    number = session.scalar(
        update(Thread)
        .where(Thread.id == thread_id, Thread.tenant_id == tenant_id)
        .values(turns=Thread.turns + 1, updated_at=utcnow())
        .returning(Thread.turns)
        .execution_options(synchronize_session=False)
    )
    if number is None:
        raise NotFound(f"no thread {thread_id}")
    return number


def lock_thread(session: Session, tenant_id: str, thread_id: str) -> Thread:
    """The tenant's thread, its row locked till the transaction ends (NotFound otherwise)."""
    locked = session.execute(
        update(Thread)
        .where(Thread.id == thread_id, Thread.tenant_id == tenant_id)
        .values(updated_at=Thread.updated_at)
        .execution_options(synchronize_session=False)
    )
    if locked.rowcount != 1:  # type: ignore[attr-defined]
        raise NotFound(f"no thread {thread_id}")
    thread = session.get(Thread, thread_id, populate_existing=True)
    assert thread is not None
    return thread


def _unfinished() -> ColumnElement[bool]:
    return Task.status.not_in(in_order(TERMINAL_STATUSES))


def unfinished_turns(session: Session, thread_id: str) -> Sequence[Task]:
    """The thread's turns not ended yet (running, waiting or held), oldest first."""
    return session.scalars(
        select(Task).where(Task.thread_id == thread_id, _unfinished()).order_by(Task.turn)
    ).all()


def hold(session: Session, task_id: str) -> None:
    """A turn just inserted ``turn_held`` waits with no due time: the dispatcher admits only
    what is due, and the sweeper looks only at what it admitted."""
    session.execute(
        update(Task)
        .where(Task.id == task_id, Task.turn_held.is_(True))
        .values(due_ms=None)
        .execution_options(synchronize_session=False)
    )


def roll_back(session: Session, task_ids: Sequence[str]) -> None:
    """These turns leave the thread's history (their rows stay)."""
    if task_ids:
        session.execute(
            update(Task)
            .where(Task.id.in_(task_ids))
            .values(rolled_back=True, updated_at=utcnow())
            .execution_options(synchronize_session=False)
        )


def _release_statements() -> tuple[Select[Any], Update]:
    """Which held turns are due for release (each thread's oldest held turn, every earlier
    turn ended), and their release: built once, as they run in every dispatcher round. The
    held turns' partial index (``ix_tasks_held``) answers the first with the predicate's
    values written into the SQL, not bound."""
    tasks, running, earlier = TASKS, TASKS.alias("running"), TASKS.alias("earlier")
    unfinished = ", ".join(f"'{status}'" for status in in_order(TERMINAL_STATUSES))
    due = (
        select(tasks.c.id)
        .where(text("tasks.turn_held AND tasks.status = 'queued'"))
        .where(
            ~exists()
            .where(running.c.thread_id == tasks.c.thread_id)
            .where(text(f"NOT running.turn_held AND running.status NOT IN ({unfinished})")),
            ~exists()
            .where(earlier.c.thread_id == tasks.c.thread_id, earlier.c.turn < tasks.c.turn)
            .where(text("earlier.turn_held AND earlier.status = 'queued'")),
        )
    )
    release = (
        update(tasks)
        .where(tasks.c.id.in_(bindparam("ids", expanding=True)))
        .where(text("tasks.turn_held AND tasks.status = 'queued'"))
        .values(turn_held=False, due_ms=now_ms(), updated_at=bindparam("now"))
        .returning(tasks.c.id)
    )
    return due, release


TASKS = cast(Table, Task.__table__)
_DUE, _RELEASE = _release_statements()


def release_held(session: Session) -> list[str]:
    """Release each thread's oldest held turn whose earlier turns have all ended: due now,
    in the backlog, for this same round to admit. Returns the turns released. A turn another
    dispatcher released meanwhile is not released twice (``turn_held`` in the UPDATE's
    condition); and should anything release a turn while another of its thread runs, the
    unique index ``uq_tasks_thread_running`` refuses the write. Nothing held: one read of
    an empty index."""
    due = list(session.execute(_DUE).scalars())
    if not due:
        return []
    return list(session.execute(_RELEASE, {"ids": due, "now": utcnow()}).scalars())


def latest_turn(session: Session, thread_id: str) -> Task | None:
    return session.scalar(
        select(Task).where(Task.thread_id == thread_id).order_by(Task.turn.desc()).limit(1)
    )


def latest_turns(session: Session, thread_ids: Sequence[str]) -> dict[str, Task]:
    """Each thread's latest turn, for a page of threads: one query."""
    if not thread_ids:
        return {}
    newest = (
        select(Task.thread_id, func.max(Task.turn).label("turn"))
        .where(Task.thread_id.in_(thread_ids))
        .group_by(Task.thread_id)
    )
    pairs = newest.subquery()
    rows = session.scalars(
        select(Task).join(
            pairs, and_(Task.thread_id == pairs.c.thread_id, Task.turn == pairs.c.turn)
        )
    ).all()
    return {row.thread_id: row for row in rows if row.thread_id is not None}


def list_threads(
    session: Session,
    tenant_id: str,
    *,
    metadata: dict[str, str],
    agent: str | None = None,
    limit: int = 50,
    after_id: str | None = None,
) -> tuple[Sequence[Thread], str | None]:
    """A page of the tenant's threads, newest first, whose metadata holds each of
    ``metadata``'s keys with that value (compared as text), and the id to continue after."""
    query = select(Thread).where(Thread.tenant_id == tenant_id)
    for key, value in metadata.items():
        query = query.where(Thread.meta[key].as_string() == value)
    if agent:
        query = query.where(Thread.agent == agent)
    if after_id:
        query = query.where(Thread.id < after_id)
    rows = session.scalars(query.order_by(Thread.id.desc()).limit(limit + 1)).all()
    more = len(rows) > limit
    return rows[:limit], (rows[limit - 1].id if more else None)


def fork_thread(
    session: Session, source: Thread, *, turn: int, metadata: dict[str, Any] | None
) -> Thread:
    """A new thread of ``source``'s tenant and agent whose history is ``source``'s turns
    1..``turn`` (read there), its own turns numbered after them; ``metadata`` (None: the
    source's). The caller has checked those turns have all ended."""
    now = utcnow()
    fork = Thread(
        id=new_id(),
        tenant_id=source.tenant_id,
        agent=source.agent,
        meta=source.meta if metadata is None else metadata,
        turns=turn,
        forked_from=source.id,
        fork_turn=turn,
        created_at=now,
        updated_at=now,
    )
    session.add(fork)
    session.flush()
    return fork


def unfinished_through(session: Session, thread_id: str, turn: int) -> list[int]:
    """The numbers of the thread's own turns up to ``turn`` not ended yet."""
    numbers = session.scalars(
        select(Task.turn).where(Task.thread_id == thread_id, Task.turn <= turn, _unfinished())
    ).all()
    return [n for n in numbers if n is not None]


def has_forks(session: Session, thread_id: str) -> bool:
    return session.scalar(select(exists().where(Thread.forked_from == thread_id))) or False


def delete_thread(session: Session, thread: Thread) -> None:
    """The thread and its turns, with everything they wrote (their rows cascade)."""
    session.delete(thread)


@dataclass(frozen=True)
class PastTurn:
    """An earlier turn as the history holds it: its input, then its completed steps with
    their tool calls (in order)."""

    task_id: str
    turn: int
    input: Any
    steps: list[Step]
    calls: list[ToolCall]


def turn_rows(
    session: Session,
    thread_id: str,
    *,
    before: int | None,
    after: int = 0,
    limit: int | None = None,
) -> list[Any]:
    """(id, turn, input, status, attempt, steps) of the turns in the thread's history (not
    rolled back), numbered after ``after`` and before ``before`` (None: all), oldest first, the
    first ``limit`` (None: all); a fork's source's turns first, up to its ``fork_turn``. One
    read, with the thread's lineage (and one more per fork in it)."""
    joined = (Task.thread_id == Thread.id) & Task.rolled_back.is_(False) & (Task.turn > after)
    if before is not None:
        joined &= Task.turn < before
    found = session.execute(
        select(
            Thread.forked_from,
            Thread.fork_turn,
            Task.id,
            Task.turn,
            Task.input,
            Task.status,
            Task.attempt,
            Task.steps,
        )
        .select_from(Thread)
        .outerjoin(Task, joined)
        .where(Thread.id == thread_id)
        .order_by(Task.turn)
        .limit(limit)
    ).all()
    if not found:
        return []
    own = [row for row in found if row.id is not None]
    source, fork_turn = found[0].forked_from, found[0].fork_turn
    if source is None or after >= fork_turn:
        return own
    cap = fork_turn + 1
    inherited = turn_rows(
        session,
        source,
        before=cap if before is None else min(before, cap),
        after=after,
        limit=limit,
    )
    rows = inherited + own
    return rows if limit is None else rows[:limit]


def turn_steps(
    session: Session, task_ids: Sequence[str]
) -> dict[str, tuple[list[Step], list[ToolCall]]]:
    """Each of these turns' completed steps and their tool calls, in order: one read. A step
    whose tools had not all run when its turn ended (cancelled mid-step) is left out, so a tool
    call is never without its outcome."""
    found: dict[str, tuple[dict[int, Step], list[ToolCall]]] = {
        task_id: ({}, []) for task_id in task_ids
    }
    if not task_ids:
        return {}
    rows = session.execute(
        select(Step, ToolCall)
        .outerjoin(
            ToolCall, (ToolCall.task_id == Step.task_id) & (ToolCall.step_number == Step.number)
        )
        .where(Step.task_id.in_(task_ids), Step.completed_at.is_not(None))
        .order_by(Step.task_id, Step.number, ToolCall.position)
    ).all()
    for step, call in rows:
        steps, calls = found[step.task_id]
        steps[step.number] = step
        if call is not None:
            calls.append(call)
    return {task_id: (list(steps.values()), calls) for task_id, (steps, calls) in found.items()}


def history(
    session: Session,
    thread_id: str,
    *,
    before: int | None = None,
    after: int = 0,
    limit: int | None = None,
) -> list[PastTurn]:
    """The thread's turns in its history (not rolled back), numbered after ``after`` and
    before ``before`` (None: all), oldest first, the first ``limit`` of them (None: all),
    each with its completed steps (:func:`turn_steps`): two reads, however many turns (and one
    per fork in its lineage: a fork's turns up to ``fork_turn`` are its source's)."""
    turns = turn_rows(session, thread_id, before=before, after=after, limit=limit)
    read = turn_steps(session, [row.id for row in turns])
    return [PastTurn(row.id, row.turn, row.input, *read[row.id]) for row in turns]
