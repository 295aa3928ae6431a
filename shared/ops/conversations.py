"""Threads as the dashboard shows them: a list (by tenant, agent and a metadata
``key:value``, keyset pages on the id, newest first) and one thread as a transcript — each
turn's user message, its steps (the model's answers and tool calls) and their calls'
outcomes, with the turn's task. A fork's transcript starts with its source's turns up to
``fork_turn``, read there as its history reads them. ``scope`` is a tenant id, or None for
the operator (every tenant)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.errors import InvalidRequest, NotFound
from shared.statuses import TERMINAL_STATUSES
from shared.store import threads
from shared.store.tables import Step, Task, Tenant, Thread, ToolCall


@dataclass(frozen=True)
class ThreadFilter:
    tenant: str | None = None  # a tenant's name (the operator's view only)
    agent: str | None = None
    metadata: str | None = None  # "key:value"

    def __post_init__(self) -> None:
        if self.metadata and ":" not in self.metadata:
            raise InvalidRequest("metadata", "is key:value")

    def as_params(self) -> dict[str, str]:
        return {k: v for k, v in vars(self).items() if v}


@dataclass(frozen=True)
class Turn:
    """One turn as the transcript shows it: ``task`` is None for a turn a fork inherited
    (only its committed steps are read there)."""

    number: int
    task_id: str
    input: Any
    steps: list[Step]
    calls: dict[int, list[ToolCall]]
    task: Task | None = None
    inherited: bool = False


@dataclass(frozen=True)
class Transcript:
    thread: Thread
    tenant: str
    status: str
    turns: list[Turn]
    forks: Sequence[Thread] = field(default_factory=list)
    running: Task | None = None  # the turn being written now, if any


def list_threads(
    session: Session, scope: str | None, where: ThreadFilter, *, limit: int, after_id: str | None
) -> tuple[list[tuple[Thread, str, str]], str | None]:
    """A page of (thread, tenant name, status), and the id to continue after."""
    query = select(Thread, Tenant.name).join(Tenant, Tenant.id == Thread.tenant_id)
    if scope is not None:
        query = query.where(Thread.tenant_id == scope)
    elif where.tenant:
        query = query.where(Tenant.name == where.tenant)
    if where.agent:
        query = query.where(Thread.agent == where.agent)
    if where.metadata:
        key, _, value = where.metadata.partition(":")
        query = query.where(Thread.meta[key].as_string() == value)
    if after_id:
        query = query.where(Thread.id < after_id)
    rows = session.execute(query.order_by(Thread.id.desc()).limit(limit + 1)).tuples().all()
    more = len(rows) > limit
    rows = rows[:limit]
    latest = threads.latest_turns(session, [t.id for t, _ in rows])
    page = [(t, name, threads.thread_status(latest.get(t.id))) for t, name in rows]
    return page, (rows[-1][0].id if more else None)


def transcript(session: Session, scope: str | None, thread_id: str) -> Transcript:
    """The thread's whole conversation; NotFound for another tenant's thread."""
    query = select(Thread, Tenant.name).join(Tenant, Tenant.id == Thread.tenant_id)
    query = query.where(Thread.id == thread_id)
    if scope is not None:
        query = query.where(Thread.tenant_id == scope)
    found = session.execute(query).tuples().one_or_none()
    if found is None:
        raise NotFound(f"no thread {thread_id}")
    thread, tenant = found
    turns = _inherited(session, thread) + _own_turns(session, thread.id)
    own = [t.task for t in turns if t.task is not None]
    running = next((t for t in own if t.status not in TERMINAL_STATUSES), None)
    forks = session.scalars(
        select(Thread).where(Thread.forked_from == thread.id).order_by(Thread.id)
    ).all()
    status = threads.thread_status(own[-1] if own else None)
    return Transcript(thread, tenant, status, turns, forks, running)


def _inherited(session: Session, thread: Thread) -> list[Turn]:
    if thread.forked_from is None or not thread.fork_turn:
        return []
    past = threads.history(session, thread.id, before=thread.fork_turn + 1)
    return [
        Turn(p.turn, p.task_id, p.input, p.steps, _by_step(p.calls), inherited=True) for p in past
    ]


def _own_turns(session: Session, thread_id: str) -> list[Turn]:
    """Every turn of the thread, rolled back ones too (marked by their task), each with all
    its steps so far: the page shows a turn while it runs."""
    tasks = session.scalars(
        select(Task).where(Task.thread_id == thread_id).order_by(Task.turn)
    ).all()
    ids = [t.id for t in tasks]
    steps: dict[str, list[Step]] = {i: [] for i in ids}
    for step in session.scalars(
        select(Step).where(Step.task_id.in_(ids)).order_by(Step.task_id, Step.number)
    ):
        steps[step.task_id].append(step)
    calls: dict[str, list[ToolCall]] = {i: [] for i in ids}
    for call in session.scalars(
        select(ToolCall)
        .where(ToolCall.task_id.in_(ids))
        .order_by(ToolCall.task_id, ToolCall.step_number, ToolCall.position)
    ):
        calls[call.task_id].append(call)
    return [
        Turn(t.turn or 0, t.id, t.input, steps[t.id], _by_step(calls[t.id]), task=t) for t in tasks
    ]


def _by_step(calls: Sequence[ToolCall]) -> dict[int, list[ToolCall]]:
    grouped: dict[int, list[ToolCall]] = {}
    for call in calls:
        grouped.setdefault(call.step_number, []).append(call)
    return grouped
