"""What a client can do to a thread: create it, send it a turn, fork it, delete it.

A turn is a task submitted as any other (the same checks, caps, webhooks and scheduling),
linked to its thread; its conversation is the thread's history plus its own input, built by
the worker from committed rows (``shared.store.threads``). A turn sent while the thread has
one unfinished follows its ``multitask_strategy``:

- ``reject``: refused (Conflict, a 409), nothing written;
- ``enqueue`` (the default): held until every earlier turn has ended, then run, seeing them;
- ``interrupt``: the unfinished turns are cancelled (a running step at its next commit point,
  a held or waiting turn at once); what they committed stays in the history, and the new turn
  runs once they have ended;
- ``rollback``: as ``interrupt``, and the cancelled turns leave the history (their rows stay).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from enum import StrEnum
from typing import Any

from sqlalchemy.orm import Session

from shared.actions import waits
from shared.actions.effects import NONE, Effects, of_task
from shared.actions.tasks import DirectSlot, Submitted, submit_once
from shared.agents.registry import get_agent
from shared.errors import Conflict, InvalidRequest, NotFound
from shared.scheduling import caps
from shared.statuses import TERMINAL_STATUSES
from shared.store import tasks, threads
from shared.store.db import get_sessionmaker
from shared.store.tables import Task, Thread
from shared.store.tasks import NewTask


class Strategy(StrEnum):
    """What a turn does to a thread that has one unfinished."""

    REJECT = "reject"
    ENQUEUE = "enqueue"
    INTERRUPT = "interrupt"
    ROLLBACK = "rollback"


def create(session: Session, tenant_id: str, *, agent: str, metadata: dict[str, Any]) -> Thread:
    """A new thread of a registered agent (InvalidRequest otherwise), with no turn yet."""
    try:
        get_agent(agent)
    except NotFound as exc:
        raise InvalidRequest("agent", str(exc)) from exc
    with session.begin():
        return threads.create_thread(session, tenant_id, agent=agent, metadata=metadata)


def run_turn(
    tenant_id: str,
    tenant_name: str,
    thread_id: str,
    spec: NewTask,
    *,
    strategy: Strategy,
    idempotency_key: str | None,
    request_hash: str,
) -> Submitted:
    """Insert ``spec`` as the thread's next turn (a queued task, held while an earlier turn
    is unfinished), after applying ``strategy`` to the unfinished ones; or, for a known
    Idempotency-Key, find the original (as ``tasks.submit_once``). NotFound for another
    tenant's thread, Conflict for ``reject`` on a busy thread. One transaction: the thread's
    row is locked first, so turns sent at once are numbered and held one after the other."""

    def insert(session: Session, slot: DirectSlot) -> Submitted:
        number = threads.take_turn_number(session, tenant_id, thread_id)
        caps.check(session, tenant_id, tenant_name)
        stopped, held = _make_room(session, tenant_id, thread_id, strategy)
        turn = replace(spec, thread_id=thread_id, turn=number, turn_held=held)
        admitted = not held and slot.take(session, tenant_name, turn)
        logged = tasks.create_task(
            session,
            tenant_id,
            turn,
            idempotency_key=idempotency_key,
            request_hash=request_hash,
            admitted=admitted,
        )
        if held:
            threads.hold(session, logged.task.id)
        done = _started(logged, admitted=admitted, held=held, thread_id=thread_id)
        return Submitted(logged.task, created=True, effects=stopped + done)

    with get_sessionmaker()() as session:
        answered = answer_question(session, tenant_id, thread_id, spec.input)
        if answered is not None:
            return answered
        return submit_once(
            session,
            tenant_id,
            idempotency_key=idempotency_key,
            request_hash=request_hash,
            insert=insert,
        )


def answer_question(
    session: Session, tenant_id: str, thread_id: str, message: Any
) -> Submitted | None:
    """The thread's next message, when its turn in flight waits on ``ask_user``: it is the
    answer (the call's result), and that turn runs on; no new turn is made. None when no
    question waits (or another answer got there first): the message is a turn of its own."""
    with session.begin():
        token = waits.open_question(session, thread_id)
    if token is None:
        return None
    text = message if isinstance(message, str) else _last_user_text(message)
    try:
        wait, effects = waits.complete(
            session, token, text, tenant_id=tenant_id, by="the thread's next message"
        )
    except (Conflict, NotFound):
        return None
    with session.begin():
        turn = tasks.get_task(session, tenant_id, wait.task_id)
    return Submitted(turn, created=False, effects=effects, answered=True)


def _last_user_text(messages: Any) -> Any:
    for message in reversed(messages if isinstance(messages, list) else []):
        if isinstance(message, dict) and message.get("role") == "user":
            return message.get("content")
    return messages


def _make_room(
    session: Session, tenant_id: str, thread_id: str, strategy: Strategy
) -> tuple[Effects, bool]:
    """Apply ``strategy`` to the thread's unfinished turns: what to send once committed, and
    whether the new turn must wait (a turn is still unfinished)."""
    unfinished = threads.unfinished_turns(session, thread_id)
    if not unfinished:
        return NONE, False
    if strategy is Strategy.ENQUEUE:
        return NONE, True
    if strategy is Strategy.REJECT:
        turns = ", ".join(str(t.turn) for t in unfinished)
        raise Conflict(
            f"thread {thread_id} has an unfinished turn ({turns}); send it with "
            "multitask_strategy enqueue, interrupt or rollback, or wait for it to end"
        )
    if strategy is Strategy.ROLLBACK:
        threads.roll_back(session, [t.id for t in unfinished])
    stopped = _cancel_all(session, tenant_id, unfinished)
    return stopped, any(t.status not in TERMINAL_STATUSES for t in unfinished)


def _cancel_all(session: Session, tenant_id: str, turns: Sequence[Task]) -> Effects:
    """Cancel each turn as ``POST /v1/tasks/{id}/cancel`` would: at once if no worker holds
    it, else at its step's next commit point (the step in flight is told to stop waiting)."""
    effects = Effects(wake=True)  # a cancel landing later wakes the dispatcher itself
    for turn in turns:
        logged = tasks.request_cancel(session, tenant_id, turn.id)
        effects += of_task(turn.id, logged.deliveries)
        if logged.task.cancel_requested_at is not None:
            effects += Effects(cancels=(turn.id,))
    return effects


def _started(logged: tasks.Logged, *, admitted: bool, held: bool, thread_id: str) -> Effects:
    """The new turn's readers (and the thread's) woken, its webhooks sent, and its first
    step sent (``admitted``) or the dispatcher woken, unless it is held."""
    task_id = logged.task.id
    effects = Effects(changed=(task_id, thread_id), deliveries=tuple(logged.deliveries))
    if admitted:
        return effects + Effects(steps=((task_id, 1),))
    return effects + Effects(wake=not held)


def delete(session: Session, tenant_id: str, thread_id: str) -> None:
    """Delete the thread with its turns and everything they wrote. Refused (Conflict) while a
    turn is unfinished: cancel it first (``POST /v1/tasks/{id}/cancel``), so nothing that is
    running loses its rows under it."""
    with session.begin():
        thread = threads.lock_thread(session, tenant_id, thread_id)
        unfinished = threads.unfinished_turns(session, thread.id)
        if unfinished:
            turns = ", ".join(str(t.turn) for t in unfinished)
            raise Conflict(
                f"thread {thread_id} has an unfinished turn ({turns}); cancel it, then delete"
            )
        if threads.has_forks(session, thread.id):
            raise Conflict(
                f"thread {thread_id} has forks, whose history it holds: delete them first"
            )
        threads.delete_thread(session, thread)


def fork(
    session: Session,
    tenant_id: str,
    thread_id: str,
    *,
    turn: int,
    metadata: dict[str, Any] | None,
) -> Thread:
    """A new thread holding the thread's turns 1..``turn`` (by reference: their committed
    steps are read, never copied, never asked for again). InvalidRequest for a turn the
    thread has not numbered; Conflict while one of those turns is unfinished (its history is
    not settled yet)."""
    with session.begin():
        source = threads.lock_thread(session, tenant_id, thread_id)
        if turn > source.turns:
            raise InvalidRequest("turn", f"thread {thread_id} has {source.turns} turns")
        unfinished = threads.unfinished_through(session, source.id, turn)
        if unfinished:
            listed = ", ".join(str(n) for n in unfinished)
            raise Conflict(
                f"thread {thread_id}'s turn {listed} is unfinished: fork once it has ended"
            )
        return threads.fork_thread(session, source, turn=turn, metadata=metadata)
