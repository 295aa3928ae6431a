"""The agent loop, one step per call: lease → model call → commit → tools → commit.

Every write is fenced by the lease epoch, so a worker that lost its lease (paused, partitioned,
a duplicate delivery) writes nothing and stops. Restarting at any point resumes from the last
commit: a checkpointed model response is replayed, never re-asked; a finished tool call is
replayed, never re-run.

Write transactions per step: the lease; the model response (which, for a final answer, also
ends the task); and per tool call its ``started`` row and its outcome — the last outcome
commits together with the step's completion, which, when the same thread goes on with the
task, also leases the next step (so a step that follows another takes no lease of its own).
Calls of one answer that may run together run at once (``workers.steps.fan_out``); then
each outcome commits alone, and the completion is a write of its own once all are settled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from redis.exceptions import ChildDeadlockedError, RedisError
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from shared import failpoints
from shared.errors import LeaseLost
from shared.observability import logs, metrics, tracing
from shared.queue import enqueue_step
from shared.ratelimit.buckets import LimiterUnavailable
from shared.settings import get_settings
from shared.statuses import TERMINAL_STATUSES
from shared.store import checkpoints, leases, ledger
from shared.store.backends import write_session
from shared.store.leases import Lease, LeaseRefused
from shared.views import TaskState
from workers import cancels, heartbeat
from workers.providers import ModelResponse
from workers.providers.base import Message
from workers.steps import approval_waits, fan_out, parking
from workers.steps.commits import TaskEnded, after_commit, complete_current_step, fail, fenced
from workers.steps.context import (
    Context,
    following_context,
    load_context,
    read_back,
    with_mcp_tools,
    worker_id,
)
from workers.steps.model import call_model, check_limits, record_response
from workers.steps.tools import run_tool_call

log = logging.getLogger("ratchet.step")


def advance(
    task_id: str, step: int | None = None, *, go_on: Callable[[], bool] = lambda: False
) -> None:
    """Run ``task_id``'s step if it is ours to run; then, while ``go_on()`` says so, the steps
    after it on this same thread; then enqueue whatever comes next.

    Going on here saves the next step its trip through the broker, its hand-off and its
    lease statements: the step's completion leases the next one in the same write. It is as
    safe as the queue: each step has a lease of its own (a new epoch), and if this process
    dies, the task's lease runs out and the sweeper sends it a message, as for any dead step.
    """
    carried = advance_one(task_id, step, go_on=go_on)
    while carried is not None and carried.lease is not None:
        carried = advance_one(task_id, carried.lease.step, carried=carried, go_on=go_on)
    if carried is not None:
        enqueue_step(task_id, carried.next_step)


class StepOutcome(StrEnum):
    """How a leased step went (a metric label and a log word)."""

    COMMITTED = "committed"  # the step completed; the task goes on
    FINISHED = "finished"  # the step ended the task (an answer, a failure, a cancel)
    ENDED = "ended"  # the step's work is over without completing it (ended, deferred)
    FENCED = "fenced"  # the lease was lost: another worker owns the task now


@dataclass(frozen=True)
class Carried:
    """What the next step takes over from the one before it on the same thread: the whole
    conversation before it, and the lease on it that the completion took, if it did.

    Committed steps never change, and a step leased by its predecessor's completion has no
    rows yet (none of it ran before: its predecessor was not complete), so it reads nothing:
    its cost does not grow with the task's history."""

    history: list[Message]
    next_step: int
    lease: Lease | None = None


def advance_one(
    task_id: str,
    step: int | None,
    *,
    carried: Carried | None = None,
    go_on: Callable[[], bool] = lambda: False,
) -> Carried | None:
    """Run one step of ``task_id`` if it is ours to run (or leased to us by the completion
    of the step before); when a next step may start at once, returns what it needs."""
    # its fields on every log line; its span in the task's trace. Each write takes a database
    # connection for its statement alone: none is held while the model or a tool works.
    with logs.bound(task_id=task_id, step=step), tracing.in_task(task_id):
        ctx = lease_step(task_id, step, carried=carried)
        if ctx is None:
            return None
        ctx.go_on = go_on
        lease = ctx.lease
        with (
            logs.bound(step=lease.step, lease_epoch=lease.epoch),
            tracing.step_span(task_id, lease.step, lease_epoch=lease.epoch) as span,
        ):
            started, outcome = time.perf_counter(), StepOutcome.ENDED
            try:
                outcome = run_leased(ctx)
            finally:
                elapsed = time.perf_counter() - started
                metrics.steps.labels(outcome=outcome).inc()
                metrics.step_seconds.observe(elapsed)
                span.set_attribute("ratchet.outcome", outcome)
                log.info("step %d %s in %.1f ms", lease.step, outcome, elapsed * 1000)
        if ctx.task.status in TERMINAL_STATUSES:
            end_task_span(ctx.task)
    if outcome is not StepOutcome.COMMITTED:
        return None
    return Carried(
        ctx.history + ctx.said,
        lease.step + 1,
        leases.next_lease(lease, ctx.task, taken_at=ctx.written_at),
    )


def end_task_span(task: TaskState) -> None:
    """The task's root span, now that this step ended it."""
    tracing.end_task(
        task.id,
        created_at=task.created_at,
        status=task.status,
        attributes={
            "ratchet.steps": task.steps,
            "gen_ai.usage.input_tokens": task.input_tokens,
            "gen_ai.usage.output_tokens": task.output_tokens,
            "ratchet.cost_usd": task.cost_usd,
        },
    )


def lease_step(task_id: str, step: int | None, *, carried: Carried | None = None) -> Context | None:
    """Take the task's lease (unless the step before took it for us) and read the step's
    context, or say why not (and come back later if another worker's lease may still run out).

    A connection that died since its last use (and was not pinged: it was back in the pool
    only a moment) fails the lease's first statement, a read; then once more on a fresh one.
    (Had it failed on the lease itself, the lease may be taken: the second try sees it held
    and comes back once it runs out.)
    """
    try:
        return _lease_step(task_id, step, carried)
    except DBAPIError as exc:
        if not exc.connection_invalidated:
            raise
        log.info("lease for %s: connection lost, once more on a fresh one", task_id)
        return _lease_step(task_id, step, carried)


def _lease_step(task_id: str, step: int | None, carried: Carried | None) -> Context | None:
    if carried is not None and carried.lease is not None:  # leased with the last completion
        return following_context(carried.lease, carried.history)
    settings = get_settings()
    with write_session() as session:
        lease = leases.take_lease(
            session,
            task_id,
            owner=worker_id(),
            ttl_ms=int(settings.lease_ttl_seconds * 1000),
            step=step,
            max_attempts=settings.max_step_attempts,
        )
        ctx = load_context(session, lease) if isinstance(lease, Lease) else None
    if isinstance(lease, LeaseRefused):
        log.info("no lease for %s: %s", task_id, lease.reason, extra={"task_id": task_id})
        if lease.retry_in_ms and step is not None:
            enqueue_step(task_id, step, delay_ms=lease.retry_in_ms + 100)
        return None
    if lease.started:
        after_commit(task_id, list(lease.deliveries))
    return ctx


def run_leased(ctx: Context) -> StepOutcome:
    """Run the leased step; say how it went."""
    lease = ctx.lease
    extra = {"task_id": lease.task_id, "step": lease.step, "lease_epoch": lease.epoch}
    try:
        with heartbeat.kept(lease), cancels.watching(lease.task_id):
            # Outside the lease's transaction, under its heartbeat: listing an MCP server's
            # tools may start the server, which takes seconds.
            with_mcp_tools(ctx)
            return StepOutcome.FINISHED if run_step(ctx) else StepOutcome.COMMITTED
    except LeaseLost as exc:
        log.warning("fenced: %s (this step's lease epoch %d)", exc, lease.epoch, extra=extra)
        return StepOutcome.FENCED
    except DBAPIError as exc:
        if not session_ended(exc):
            return give_up_or_fail(ctx, exc)
        # The database ended this worker's session (it stalled past the idle-in-transaction
        # limit, or was cut off): its open transaction was rolled back. As when fenced, stop;
        # the lease runs out and the task carries on elsewhere.
        log.warning(
            "fenced: task %s: the database ended this worker's session (lease epoch %d); "
            "a write it had sent committed whole or not at all: %s",
            lease.task_id,
            lease.epoch,
            exc.orig,
            extra=extra,
        )
        return StepOutcome.FENCED
    except TaskEnded:
        return StepOutcome.ENDED
    except Exception as exc:
        return give_up_or_fail(ctx, exc)


def give_up_or_fail(ctx: Context, exc: Exception) -> StepOutcome:
    """An unexpected error: if another try may go otherwise, raise it (the lease runs out and
    the step runs again, here or elsewhere); otherwise fail the task with it."""
    if transient(exc) or isinstance(exc, failpoints.InjectedFault):  # the latter: a crash
        raise exc
    return fail_on_error(ctx, exc)


def transient(exc: Exception) -> bool:
    """Whether another try may go otherwise: the database or Redis out of reach, a timeout
    (the connection pool's too: every connection of the process busy for its whole wait).
    Anything else (a value out of range, a constraint, a bug) fails the same way each time."""
    if isinstance(exc, DBAPIError):
        return session_ended(exc) or isinstance(exc, OperationalError | InterfaceError)
    away = RedisError | OSError | TimeoutError | PoolTimeout | DisconnectionError
    away |= ChildDeadlockedError  # a Redis pool locked across a fork: not the task's doing
    return isinstance(exc, away | LimiterUnavailable)


def fail_on_error(ctx: Context, exc: Exception) -> StepOutcome:
    """A step that would fail the same way on every try fails its task now, with the real
    error, rather than being retried until it looks like a worker that keeps dying."""
    lease = ctx.lease
    log.exception(
        "step %d failed with an error that a retry would meet again: the task fails",
        lease.step,
        extra={"task_id": lease.task_id, "step": lease.step, "lease_epoch": lease.epoch},
    )
    try:
        fail(ctx, "internal_error", describe(exc))
    except TaskEnded:
        return StepOutcome.ENDED


def describe(exc: Exception) -> str:
    """The error as a client may read it: its type and message, never SQL or its parameters."""
    cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return f"{type(cause).__name__}: {text}"[:500]


def session_ended(exc: DBAPIError) -> bool:
    """Whether the database dropped the session (rather than rejected a statement)."""
    sqlstate = str(getattr(exc.orig, "sqlstate", "") or "")
    return exc.connection_invalidated or sqlstate == "25P03" or sqlstate[:2] in ("08", "57")


def run_calls(
    ctx: Context, response: ModelResponse, waiting: list[int]
) -> tuple[bool, list[int], frozenset[str], list[str]]:
    """Run the calls that need no decision: at once when there are several (each outcome
    committed alone), else one after the other, the last committing the step's completion
    unless calls wait. Returns whether the completion was committed; the positions waiting
    for a person and the calls among them asked again; the calls parked on waits."""
    ready = [p for p in range(len(response.tool_calls)) if p not in waiting]
    if len(ready) > 1 and get_settings().tool_concurrency > 1:
        again, parked = fan_out.run_calls(ctx, response, ready)
        asked = frozenset(ledger.call_id(ctx.lease.step, p) for p in again)
        return False, sorted({*waiting, *again}), asked, parked
    completed, asked, parked = False, frozenset[str](), []
    for position in ready:
        last = not waiting and not parked and position == ready[-1]
        try:
            completed = run_tool_call(ctx, position, response.tool_calls[position], last=last)
        except approval_waits.AskAgain as ask:  # the calls after it run once it is decided
            return completed, sorted({*waiting, position}), frozenset({ask.call_id}), parked
        except parking.Parked as park:  # the step parks once the others ran
            parked.append(park.call_id)
    return completed, waiting, asked, parked


def subagent(ctx: Context, name: str) -> bool:
    tool = ctx.tools.get(name)
    return tool is not None and tool.agent is not None


def run_step(ctx: Context) -> bool:
    """Run ``lease.step``; return True when the task reached a terminal state."""
    lease = ctx.lease
    if ctx.step_row is None:
        check_limits(ctx)
        answer = call_model(ctx)
        if record_response(ctx, answer):
            return True
        failpoints.hit("after_model_commit")
        response = answer.response
    else:
        response = ModelResponse.from_dict(ctx.step_row.response)
    waiting = approval_waits.find_waiting(ctx, response)
    ctx.subagent_calls = sum(1 for c in response.tool_calls if subagent(ctx, c.name)) or 1
    completed, waiting, asked, parked = run_calls(ctx, response, waiting)
    if waiting:
        approval_waits.wait(ctx, response, waiting, asked=asked)
    if parked:
        parking.park_task(ctx, response, parked)
    if not completed:  # resumed after the last call's outcome was already committed
        with fenced(ctx) as writes:
            writes.set(complete_current_step(ctx))
            writes.add(checkpoints.complete_checkpoint(lease))
    ctx.said = read_back(ctx, response)
    failpoints.hit("after_step_commit")
    return False
