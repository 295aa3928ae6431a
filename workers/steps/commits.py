"""A step's fenced writes: gathered in a ``fenced`` block and made when it ends, with their
webhooks and wake-ups sent once committed; and the writes that end a task from inside a step."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

from shared import failpoints
from shared.actions import effects, waits
from shared.errors import CancelRequested
from shared.sandbox import workspaces
from shared.statuses import TERMINAL_STATUSES, TaskStatus
from shared.store.backends import write_session
from shared.store.batch import Part
from shared.store.db import get_sessionmaker
from shared.store.step_write import (
    CANCELLED_ERROR,
    TaskWrite,
    complete_step,
    finish_task,
    write,
)
from workers import webhook_sender
from workers.steps.context import Context, worker_id

log = logging.getLogger("ratchet.step")


class TaskEnded(Exception):
    """This message's work is over: the task reached a terminal state or was deferred."""


def after_commit(task_id: str, deliveries: list[str], *, turn_ended: bool = False) -> None:
    """Once events are committed: wake their readers and send their webhooks from this
    process's own sender (``effects.after_commit``). Neither may fail the step: the sweeper
    re-sends due deliveries, and readers poll as a fallback. A thread's turn that ended
    wakes the dispatcher, which releases the thread's next turn (``shared.store.threads``)."""
    done = effects.of_task(task_id, deliveries, wake=turn_ended)
    effects.after_commit(done, send_webhooks=send_here)


def turn_ended(ctx: Context) -> bool:
    """The write ended a thread's turn: its next turn may be waiting."""
    return ctx.task.thread_id is not None and ctx.task.status in TERMINAL_STATUSES


def send_here(deliveries: list[str]) -> None:
    """Hand committed deliveries to this worker process's sending threads."""
    failpoints.hit("before_webhooks")
    webhook_sender.dispatch(deliveries)


@dataclass
class Writes:
    """One fenced write, gathered in the ``fenced`` block and made when it ends."""

    ctx: Context
    change: TaskWrite = field(default_factory=TaskWrite)
    parts: list[Part] = field(default_factory=list)
    deliveries: list[str] = field(default_factory=list)

    def set(self, change: TaskWrite) -> None:
        """What the write does to the task (an intent of ``shared.store.step_write``)."""
        self.change = change

    def add(self, *parts: Part) -> None:
        """Checkpoint or ledger rows written with it, all or nothing."""
        self.parts += parts

    def commit(self) -> None:
        """Make the write, on the task as the step's last write left it. Once the task has
        ended (a call that runs beside this one ended it: workers.steps.fan_out) there is
        nothing more to write: raises TaskEnded."""
        with self.ctx.writing:
            if self.ctx.task.status in TERMINAL_STATUSES:
                raise TaskEnded
            self.ctx.written_at = time.monotonic()
            with write_session() as session:
                written = write(
                    session,
                    self.ctx.lease,
                    task=self.ctx.task,
                    change=self.change,
                    parts=self.parts,
                )
            self.ctx.task, self.deliveries = written.task, written.deliveries


@contextmanager
def fenced(ctx: Context) -> Iterator[Writes]:
    """Gather one fenced write, then make it; its webhooks and wake-ups go out once it
    commits. A requested cancellation surfaces at the fence; the task is then cancelled by a
    write of its own and the step ends."""
    writes = Writes(ctx)
    yield writes
    try:
        writes.commit()
    except CancelRequested:
        cancel = Writes(ctx, finish_task(TaskStatus.CANCELLED, error=CANCELLED_ERROR))
        cancel.commit()
        after_commit(ctx.task.id, cancel.deliveries, turn_ended=turn_ended(ctx))
        family_after_end(ctx)
        raise TaskEnded from None
    after_commit(ctx.task.id, writes.deliveries, turn_ended=turn_ended(ctx))
    if ctx.task.status in TERMINAL_STATUSES:
        family_after_end(ctx)


def family_after_end(ctx: Context) -> None:
    """A task that ended settles its parent's wait on it (which resumes the parent if it was
    its last), cancels whatever it started that is still running, and its ``run_python``
    workspace on this host is removed. None of it may fail the step: the sweeper settles what
    a crash here left pending, and removes what is left of workspaces."""
    task = ctx.task
    workspaces.remove(task.id)
    if task.parent_id is not None:
        failpoints.hit("after_child_end")
    try:
        with get_sessionmaker()() as session:
            if task.parent_id is not None:
                effects.after_commit(waits.settle_child(session, task.id), send_webhooks=send_here)
            if any(tool.agent is not None for tool in ctx.tools.values()):
                below = waits.cancel_tree(session, task.tenant_id, task.id)
                effects.after_commit(below, send_webhooks=send_here)
    except Exception:
        log.exception("task %s ended; its family is left to the sweeper", task.id)


def cancel(ctx: Context, *parts: Part) -> NoReturn:
    """The task was cancelled while the step waited: end it now, with ``parts``."""
    with fenced(ctx) as writes:
        writes.set(finish_task(TaskStatus.CANCELLED, error=CANCELLED_ERROR))
        writes.add(*parts)
    raise TaskEnded


def fail(ctx: Context, error_type: str, message: str, **detail: Any) -> NoReturn:
    error = {"type": error_type, "message": message, **detail}
    with fenced(ctx) as writes:
        writes.set(finish_task(TaskStatus.FAILED, error=error))
    raise TaskEnded


def complete_current_step(ctx: Context) -> TaskWrite:
    """The write that completes the step; if this thread goes on with the next step, the same
    write leases it (one statement fewer than a lease of its own)."""
    return complete_step(ctx.lease, next_owner=worker_id() if ctx.go_on() else None)
