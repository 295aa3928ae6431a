"""The agent loop, one step per call: lease → model call → commit → tools → commit.

Every write is fenced by the lease epoch, so a worker that lost its lease (paused, partitioned,
a duplicate delivery) writes nothing and stops. Restarting at any point resumes from the last
commit: a checkpointed model response is replayed, never re-asked; a finished tool call is
replayed, never re-run.

Write transactions per step: the lease; the model response (which, for a final answer, also
ends the task); and per tool call its ``started`` row and its outcome — the last outcome
commits together with the step's completion, which, when the same thread goes on with the
task, also leases the next step (so a step that follows another takes no lease of its own).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any, NoReturn

from opentelemetry.trace import StatusCode
from redis.exceptions import RedisError
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session

from shared import failpoints, notify
from shared.agents.registry import Agent, Tool, ToolContext, get_agent, get_registry
from shared.errors import CancelRequested, LeaseLost, ModelError
from shared.observability import logs, metrics, tracing
from shared.pricing import cost_usd
from shared.queue import enqueue_step
from shared.ratelimit.limiter import LimiterUnavailable
from shared.settings import get_settings
from shared.store import checkpoints, leases, ledger
from shared.store.batch import Part
from shared.store.db import write_session
from shared.store.fenced import EventSpec
from shared.store.leases import Lease, LeaseRefused
from shared.store.tables import Step, TaskStatus, Tenant, ToolCall, utcnow
from shared.store.writes import (
    CANCELLED_ERROR,
    progress_values,
    release_values,
    terminal_values,
    usage_values,
    write,
)
from shared.views import TaskState, task_document
from workers import cancels, heartbeat, model_calls, tool_runner, webhook_sender
from workers.providers import ModelRequest, ModelResponse, ToolCallRequest, get_provider
from workers.providers.base import Message, ToolSchema

log = logging.getLogger("ratchet.step")
KEPT_ATTEMPTS = 20  # failed model calls of a step kept for its timeline (the latest)


class TaskEnded(Exception):
    """This message's work is over: the task reached a terminal state or was deferred."""


@dataclass
class Context:
    """What a step needs, read when the lease is taken. ``task`` is the row as this lease
    holder last left it (each write of the step moves it on)."""

    lease: Lease
    task: TaskState
    agent: Agent
    tools: dict[str, Tool]
    history: list[Message]
    step_row: Step | None
    calls: dict[str, ToolCall]
    tenant_name: str
    clock_ms: int
    # Asked when the step completes: whether this thread goes on with the next step (then the
    # completion leases it in the same write).
    go_on: Callable[[], bool] = lambda: False
    # What the model reads back of this step, once it is complete: its answer, then each tool
    # call's outcome (kept for the next step on this thread).
    said: list[Message] = field(default_factory=list)
    outcomes: dict[str, tool_runner.Outcome] = field(default_factory=dict)


def worker_id() -> str:
    """``host:pid:thread``: who holds a lease (the pid is read each time: workers fork)."""
    return f"{_HOST}:{os.getpid()}:{threading.get_ident()}"


_HOST = socket.gethostname()


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
            started, outcome = time.perf_counter(), "ended"
            try:
                outcome = run_leased(ctx)
            finally:
                elapsed = time.perf_counter() - started
                metrics.steps.labels(outcome=outcome).inc()
                metrics.step_seconds.observe(elapsed)
                span.set_attribute("ratchet.outcome", outcome)
                log.info("step %d %s in %.1f ms", lease.step, outcome, elapsed * 1000)
        if ctx.task.status in TaskStatus.TERMINAL:
            end_task_span(ctx.task)
    if outcome != "committed":
        return None
    return Carried(ctx.history + ctx.said, lease.step + 1, leases.next_lease(lease, ctx.task))


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


def run_leased(ctx: Context) -> str:
    """Run the leased step; returns "committed", "finished", "ended" or "fenced"."""
    lease = ctx.lease
    extra = {"task_id": lease.task_id, "step": lease.step, "lease_epoch": lease.epoch}
    try:
        with heartbeat.kept(lease), cancels.watching(lease.task_id):
            return "finished" if run_step(ctx) else "committed"
    except LeaseLost as exc:
        log.warning("fenced: %s", exc, extra=extra)
        return "fenced"
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
        return "fenced"
    except TaskEnded:
        return "ended"
    except Exception as exc:
        return give_up_or_fail(ctx, exc)


def give_up_or_fail(ctx: Context, exc: Exception) -> str:
    """An unexpected error: if another try may go otherwise, raise it (the lease runs out and
    the step runs again, here or elsewhere); otherwise fail the task with it."""
    if transient(exc) or isinstance(exc, failpoints.InjectedFault):  # the latter: a crash
        raise exc
    return fail_on_error(ctx, exc)


def transient(exc: Exception) -> bool:
    """Whether another try may go otherwise: the database or Redis out of reach, a timeout.
    Anything else (a value out of range, a constraint, a bug) fails the same way each time."""
    if isinstance(exc, DBAPIError):
        return session_ended(exc) or isinstance(exc, OperationalError | InterfaceError)
    return isinstance(exc, RedisError | OSError | TimeoutError | LimiterUnavailable)


def fail_on_error(ctx: Context, exc: Exception) -> str:
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
        return "ended"


def describe(exc: Exception) -> str:
    """The error as a client may read it: its type and message, never SQL or its parameters."""
    cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return f"{type(cause).__name__}: {text}"[:500]


def session_ended(exc: DBAPIError) -> bool:
    """Whether the database dropped the session (rather than rejected a statement)."""
    sqlstate = str(getattr(exc.orig, "sqlstate", "") or "")
    return exc.connection_invalidated or sqlstate == "25P03" or sqlstate[:2] in ("08", "57")


def after_commit(task_id: str, deliveries: list[str]) -> None:
    """Once events are committed: send their webhooks and wake their readers. Neither may
    fail the step: the sweeper re-sends due deliveries, and readers poll as a fallback."""
    notify.publish([task_id])
    webhook_sender.dispatch(deliveries)


@dataclass
class Writes:
    """One fenced write, gathered in the ``fenced`` block and made when it ends."""

    ctx: Context
    values: dict[str, Any] = field(default_factory=dict)
    events: list[EventSpec] = field(default_factory=list)
    parts: list[Part] = field(default_factory=list)
    honour_cancel: bool = True
    deliveries: list[str] = field(default_factory=list)

    def write(
        self, *, values: dict[str, Any] | None = None, events: Sequence[EventSpec] = ()
    ) -> None:
        self.values, self.events = values or {}, list(events)

    def finish(self, status: str, **kwargs: Any) -> None:
        """End the task: the terminal values and ``task.<status>`` event."""
        self.write(
            values=terminal_values(status, **kwargs),
            events=[(f"task.{status}", task_document)],
        )
        self.honour_cancel = status != TaskStatus.CANCELLED

    def add(self, *parts: Part) -> None:
        """Checkpoint or ledger rows written with it, all or nothing."""
        self.parts += parts

    def commit(self) -> None:
        with write_session() as session:
            written = write(
                session,
                self.ctx.lease,
                task=self.ctx.task,
                values=self.values,
                events=self.events,
                parts=self.parts,
                honour_cancel=self.honour_cancel,
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
        cancel = Writes(ctx)
        cancel.finish(TaskStatus.CANCELLED, error=CANCELLED_ERROR)
        cancel.commit()
        after_commit(ctx.task.id, cancel.deliveries)
        raise TaskEnded from None
    after_commit(ctx.task.id, writes.deliveries)


def cancel(ctx: Context, *parts: Part) -> NoReturn:
    """The task was cancelled while the step waited: end it now, with ``parts``."""
    with fenced(ctx) as writes:
        writes.finish(TaskStatus.CANCELLED, error=CANCELLED_ERROR)
        writes.add(*parts)
    raise TaskEnded


def fail(ctx: Context, error_type: str, message: str, **detail: Any) -> NoReturn:
    error = {"type": error_type, "message": message, **detail}
    with fenced(ctx) as writes:
        writes.finish(TaskStatus.FAILED, error=error)
    raise TaskEnded


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
    completed = False
    for position, call in enumerate(response.tool_calls):
        completed = run_tool_call(
            ctx, position, call, last=position == len(response.tool_calls) - 1
        )
    if not completed:  # resumed after the last call's outcome was already committed
        with fenced(ctx) as writes:
            writes.write(**completion(ctx))
            writes.add(checkpoints.completion(lease))
    ctx.said = said(ctx, response)
    failpoints.hit("after_step_commit")
    return False


def said(ctx: Context, response: ModelResponse) -> list[Message]:
    """The completed step as the model reads it back: what ``step_messages`` rebuilds from its
    rows, made from what this step answered and recorded. (The same JSON; an object read back
    from PostgreSQL may list its keys in another order.)"""
    answer = response.to_dict()
    messages: list[Message] = [
        {"role": "assistant", "content": answer["content"], "tool_calls": answer["tool_calls"]}
    ]
    for position, call in enumerate(response.tool_calls):
        call_id = ledger.call_id(ctx.lease.step, position)
        outcome = ctx.outcomes.get(call_id)
        if outcome is None:  # settled before this lease: as its row says
            row = ctx.calls[call_id]
            outcome = tool_runner.Outcome(
                ok=row.status == ledger.SUCCEEDED, result=row.result, error=row.error
            )
        content = tool_runner.message_content(
            ok=outcome.ok, result=outcome.result, error=outcome.error
        )
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}
        )
    return messages


def completion(ctx: Context) -> dict[str, Any]:
    """The task values and event that complete the step; if this thread goes on with the
    next step, the same write leases it (one statement fewer than a lease of its own)."""
    lease = ctx.lease
    next_owner = worker_id() if ctx.go_on() else None
    return {
        "values": progress_values(lease, next_owner=next_owner),
        "events": [("step.completed", {"step": lease.step})],
    }


def load_context(session: Session, lease: Lease) -> Context:
    """Everything the step needs, read in the lease's transaction.

    A task's very first lease has no history and nothing to resume: it reads nothing more.
    """
    task = lease.task
    assert task is not None
    fresh = lease.fresh  # never ran: a retried task (attempt 1 again) has rows to resume
    steps, calls = ([], []) if fresh else checkpoints.load_history(session, lease.task_id)
    agent = get_agent(task.agent)
    done = [s for s in steps if s.number < lease.step]
    current = next((s for s in steps if s.number == lease.step), None)
    return Context(
        lease=lease,
        task=task,
        agent=agent,
        tools=task_tools(task),
        history=opening(task, agent) + step_messages(done, calls),
        step_row=current,
        calls={c.call_id: c for c in calls if c.step_number == lease.step},
        tenant_name=tenant_name(task.tenant_id, session),
        clock_ms=lease.clock_ms,
    )


def following_context(lease: Lease, history: list[Message]) -> Context:
    """The context of a step leased by its predecessor's completion, from memory: the step
    has no rows yet, and the conversation before it was carried over."""
    task = lease.task
    assert task is not None
    return Context(
        lease=lease,
        task=task,
        agent=get_agent(task.agent),
        tools=task_tools(task),
        history=history,
        step_row=None,
        calls={},
        tenant_name=tenant_name(task.tenant_id),
        clock_ms=lease.clock_ms,
    )


def task_tools(task: TaskState) -> dict[str, Tool]:
    registry = get_registry()
    return {name: registry.tools[name] for name in task.tools if name in registry.tools}


_tenant_names: dict[str, str] = {}


def tenant_name(tenant_id: str, session: Session | None = None) -> str:
    """Tenant names never change, so each process looks each one up once: in ``session``,
    if the caller holds one (a second connection while holding one could wait forever on a
    pool that every step thread drained the same way), else in a session of its own."""
    name = _tenant_names.get(tenant_id)
    if name is None:
        with nullcontext(session) if session is not None else write_session() as reader:
            found = reader.scalar(select(Tenant.name).where(Tenant.id == tenant_id))
        name = _tenant_names[tenant_id] = found or tenant_id
    return name


def opening(task: TaskState, agent: Agent) -> list[Message]:
    """The chat before any step: the system prompt and the task's input."""
    system = "\n\n".join(p for p in (agent.system_prompt, task.instructions) if p)
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    if isinstance(task.input, str):
        messages.append({"role": "user", "content": task.input})
    else:
        messages.extend({"role": m["role"], "content": m["content"]} for m in task.input)
    return messages


def step_messages(steps: Sequence[Step], calls: Sequence[ToolCall]) -> list[Message]:
    """Each step's response and its tool calls' outcomes, as the model reads them back."""
    by_step: dict[int, list[ToolCall]] = defaultdict(list)
    for call in calls:
        by_step[call.step_number].append(call)
    messages: list[Message] = []
    for step in steps:
        messages.append(
            {
                "role": "assistant",
                "content": step.response.get("content"),
                "tool_calls": step.response.get("tool_calls", []),
            }
        )
        for call in by_step[step.number]:
            content = tool_runner.message_content(
                ok=call.status == ledger.SUCCEEDED, result=call.result, error=call.error
            )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.provider_call_id,
                    "name": call.tool,
                    "content": content,
                }
            )
    return messages


def check_limits(ctx: Context) -> None:
    """Limits checked before each model call; each ends the task with the reason."""
    task, lease = ctx.task, ctx.lease
    if task.cancel_requested_at is not None:
        with fenced(ctx) as writes:
            writes.finish(TaskStatus.CANCELLED, error=CANCELLED_ERROR)
        raise TaskEnded
    if lease.step > task.max_steps:
        fail(ctx, "max_steps_exceeded", f"the task reached max_steps ({task.max_steps})")
    if task.deadline_ms is not None and ctx.clock_ms > task.deadline_ms:
        fail(ctx, "deadline_exceeded", "the task ran past its wall-clock deadline")


@dataclass(frozen=True)
class Answer:
    response: ModelResponse
    latency_ms: int
    started_at: datetime


def call_model(ctx: Context) -> Answer:
    """Ask the model for this step (rate limits, retries and 429 feedback included)."""
    provider, model_name = get_provider(ctx.task.model)
    request = ModelRequest(
        task_id=ctx.task.id,
        step=ctx.lease.step,
        model=model_name,
        messages=ctx.history,
        tools=[ToolSchema(t.name, t.description, t.parameters_schema) for t in ctx.tools.values()],
        options=ctx.task.model_options,
    )
    started_at, started = utcnow(), time.monotonic()
    # This step's failed calls so far (earlier messages' too): the timeline shows them.
    failed = list((ctx.task.waiting or {}).get("model_attempts", []))
    failpoints.hit("model_call")
    with tracing.model_span(ctx.task.model) as span:
        try:
            response = cancels.call(
                partial(
                    model_calls.complete,
                    provider,
                    request,
                    model=ctx.task.model,
                    tenant=ctx.tenant_name,
                    prior_failures=ctx.task.model_failures,
                    failed=failed,
                ),
                name="model",
            )
        except cancels.Interrupted:
            span.set_status(StatusCode.ERROR, "cancelled")
            cancel(ctx)
        except ModelError as exc:
            span.set_status(StatusCode.ERROR, str(exc))
            fail(ctx, exc.error_type, str(exc), attempts=failed[-KEPT_ATTEMPTS:])
        except model_calls.Deferred as deferred:
            span.set_attribute("ratchet.deferred_ms", int(deferred.delay_s * 1000))
            defer(ctx, deferred, failed=failed[-KEPT_ATTEMPTS:])
        span.set_attributes(
            {
                "gen_ai.usage.input_tokens": response.input_tokens,
                "gen_ai.usage.output_tokens": response.output_tokens,
            }
        )
    return Answer(response, int((time.monotonic() - started) * 1000), started_at)


def defer(
    ctx: Context, deferred: model_calls.Deferred, *, failed: list[dict[str, Any]]
) -> NoReturn:
    """Give the lease back and come back for this step after the wait, via the queue."""
    lease = ctx.lease
    cap_ms = get_settings().visibility_timeout_seconds * 500  # never an ETA the broker redelivers
    delay_ms = min(int(deferred.delay_s * 1000), cap_ms)
    values = release_values(
        lease,
        delay_ms=delay_ms,
        model_failures=deferred.failures,
        waiting={**deferred.reason, "retry_in_ms": delay_ms, "model_attempts": failed},
    )
    with fenced(ctx) as writes:
        writes.write(values=values)
    log.info(
        "step waits %d ms via the queue: %s",
        delay_ms,
        deferred.reason,
        extra={"task_id": lease.task_id},
    )
    enqueue_step(lease.task_id, lease.step, delay_ms=delay_ms)
    raise TaskEnded


def record_response(ctx: Context, answer: Answer) -> bool:
    """Checkpoint the model's answer in one write; a final answer (no tool calls) or a blown
    budget also ends the task there. Returns whether the task ended."""
    response, lease, task = answer.response, ctx.lease, ctx.task
    cost = cost_usd(
        task.model, input_tokens=response.input_tokens, output_tokens=response.output_tokens
    )
    values = usage_values(
        input_tokens=response.input_tokens, output_tokens=response.output_tokens, cost_usd=cost
    )
    events: list[EventSpec] = [("step.model_response", _response_event(lease.step, response, cost))]
    over_budget = budget_exceeded(task, response.input_tokens + response.output_tokens, cost)
    final = not response.tool_calls and not over_budget
    if over_budget or final:
        ending, ending_events = _ending(lease.step, response, over_budget=over_budget)
        values |= ending
        events += ending_events
    call = checkpoints.ModelCall(
        response=response.to_dict(),
        input_tokens=response.input_tokens,
        output_tokens=response.output_tokens,
        cost_usd=cost,
        latency_ms=answer.latency_ms,
        started_at=answer.started_at,
    )
    with fenced(ctx) as writes:
        writes.write(values=values, events=events)
        writes.add(checkpoints.model_response(lease, call, final=final))
    return final or bool(over_budget)


def _response_event(step: int, response: ModelResponse, cost: float) -> dict[str, Any]:
    """The ``step.model_response`` event: the answer, its tool calls' ids and its usage."""
    said = response.to_dict()
    for position, call in enumerate(said["tool_calls"]):
        call["call_id"] = ledger.call_id(step, position)  # the id the ledger and API use
    usage = {
        "input_tokens": response.input_tokens,
        "output_tokens": response.output_tokens,
        "cost_usd": cost,
    }
    return {"step": step, **said, "usage": usage}


def _ending(
    step: int, response: ModelResponse, *, over_budget: str | None
) -> tuple[dict[str, Any], list[EventSpec]]:
    """The values and events that end the task with this answer: failed over its budget,
    or succeeded with the answer as its output."""
    if over_budget:
        error = {"type": "budget_exceeded", "message": over_budget}
        return terminal_values(TaskStatus.FAILED, error=error), [("task.failed", task_document)]
    values = terminal_values(
        TaskStatus.SUCCEEDED, result={"output": response.content or ""}, steps=step
    )
    return values, [("step.completed", {"step": step}), ("task.succeeded", task_document)]


def budget_exceeded(task: TaskState, tokens: int, cost: float) -> str | None:
    budget = task.budget or {}
    max_tokens, max_cost = budget.get("max_tokens"), budget.get("max_cost_usd")
    total_tokens = task.input_tokens + task.output_tokens + tokens
    if max_tokens is not None and total_tokens > max_tokens:
        return f"the task used {total_tokens} tokens, over its budget of {max_tokens}"
    if max_cost is not None and task.cost_usd + cost > max_cost:
        return f"the task cost ${task.cost_usd + cost:.4f}, over its budget of ${max_cost}"
    return None


def run_tool_call(ctx: Context, position: int, call: ToolCallRequest, *, last: bool) -> bool:
    """Run one call through the ledger: replay a finished call, decide about a started one.

    The last call's outcome commits together with the step's completion (one commit fewer);
    returns whether that happened.
    """
    lease = ctx.lease
    call_id = ledger.call_id(lease.step, position)
    row = ctx.calls.get(call_id)
    if row is not None and row.status != ledger.STARTED:
        return False
    tool = ctx.tools.get(call.name)
    if row is not None and tool is not None and not tool.idempotent:
        return resolve_unknown_outcome(ctx, tool, call_id, last=last)
    with fenced(ctx) as writes:
        if row is None:
            started = ledger.started(
                lease,
                position=position,
                call_id=call_id,
                provider_call_id=call.id,
                tool=call.name,
                arguments=call.arguments,
            )
            writes.add(started)
        else:
            writes.add(ledger.rerun(lease, call_id))
    failpoints.hit("tool_call")
    try:
        outcome = invoke(ctx, tool, call, call_id)
    except cancels.Interrupted:
        abandoned = (
            "the task was cancelled while the call ran: stopped, or abandoned if it could not be"
        )
        cancel(ctx, ledger.outcome(call_id, status=ledger.FAILED, result=None, error=abandoned))
    failpoints.hit("after_tool")
    if outcome.unknown and tool is not None and not tool.idempotent:
        # An abandoned call may still act: as after a crash, the tool's policy decides.
        why = f"{outcome.error}; it may still complete"
        return resolve_unknown_outcome(ctx, tool, call_id, why=why, last=last)
    record_outcome(ctx, call_id=call_id, name=call.name, outcome=outcome, last=last)
    return last


def invoke(
    ctx: Context, tool: Tool | None, call: ToolCallRequest, call_id: str
) -> tool_runner.Outcome:
    if tool is None:
        return tool_runner.Outcome(
            ok=False,
            error=f"unknown tool {call.name!r}; available: {', '.join(ctx.tools) or 'none'}",
        )
    if call.invalid_arguments is not None:
        return tool_runner.Outcome(
            ok=False, error=f"arguments are not a JSON object: {call.invalid_arguments[:200]}"
        )
    watch = cancels.current()
    context = ToolContext(
        task_id=ctx.task.id,
        tenant_id=ctx.task.tenant_id,
        call_id=call_id,
        idempotency_key=ledger.idempotency_key(ctx.task.id, call_id),
        cancelled=watch.cancelled if watch is not None else threading.Event(),
    )
    with tracing.tool_span(tool.name, call_id=call_id) as span:
        outcome = tool_runner.execute(tool, call.arguments, context)
        if not outcome.ok:
            span.set_status(StatusCode.ERROR, outcome.error or "failed")
    return outcome


def record_outcome(
    ctx: Context,
    *,
    call_id: str,
    name: str,
    outcome: tool_runner.Outcome,
    last: bool,
    end_task: dict[str, Any] | None = None,
) -> None:
    """Commit a call's outcome; with ``last`` the step completes in the same write, with
    ``end_task`` (an error) the task fails in it."""
    lease = ctx.lease
    ctx.outcomes[call_id] = outcome
    status = ledger.SUCCEEDED if outcome.ok else ledger.FAILED
    metrics.tool_calls.labels(tool=name if name in ctx.tools else "unknown", status=status).inc()
    event = {
        "step": lease.step,
        "call_id": call_id,
        "name": name,
        "status": status,
        "result": outcome.result,
        "error": outcome.error,
    }
    events: list[EventSpec] = [("step.tool_call", event)]
    values: dict[str, Any] = {}
    if end_task is not None:
        values = terminal_values(TaskStatus.FAILED, error=end_task)
        events.append(("task.failed", task_document))
    elif last:
        done = completion(ctx)
        values, events = done["values"], events + done["events"]
    with fenced(ctx) as writes:
        writes.write(values=values, events=events)
        writes.add(
            ledger.outcome(call_id, status=status, result=outcome.result, error=outcome.error)
        )
        if last and end_task is None:
            writes.add(checkpoints.completion(lease))


def resolve_unknown_outcome(
    ctx: Context,
    tool: Tool,
    call_id: str,
    *,
    why: str = "was interrupted by a crash",
    last: bool = False,
) -> bool:
    """A non-idempotent call whose outcome is unknown: apply the tool's policy. Returns
    whether the step's completion was committed with it."""
    message = (
        f"tool call {call_id} ({tool.name}) {why}; its outcome is unknown "
        "and the tool is not idempotent, so it was not run again"
    )
    unknown = tool_runner.Outcome(ok=False, error=message)
    if tool.on_unknown_outcome == "tell_model":
        record_outcome(ctx, call_id=call_id, name=tool.name, outcome=unknown, last=last)
        return last
    error = {"type": "tool_outcome_unknown", "message": message}
    record_outcome(
        ctx, call_id=call_id, name=tool.name, outcome=unknown, last=False, end_task=error
    )
    raise TaskEnded
