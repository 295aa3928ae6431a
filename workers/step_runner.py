"""The agent loop, one step per call: lease → model call → commit → tools → commit.

Every write is fenced by the lease epoch, so a worker that lost its lease (paused, partitioned,
a duplicate delivery) writes nothing and stops. Restarting at any point resumes from the last
commit: a checkpointed model response is replayed, never re-asked; a finished tool call is
replayed, never re-run.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import NoReturn

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared import checkpoints, failpoints, ledger, task_store
from shared.db import now_ms, transaction
from shared.errors import LeaseLost, ModelError
from shared.events import append_event
from shared.models import Step, Task, TaskStatus, Tenant, ToolCall, utcnow
from shared.pricing import cost_usd
from shared.queue import enqueue_step
from shared.registry import Agent, Tool, ToolContext, get_agent, get_registry
from shared.settings import get_settings
from shared.task_store import Lease, LeaseRefused
from workers import model_calls, tool_runner
from workers.models import ModelRequest, ModelResponse, ToolCallRequest, get_provider
from workers.models.base import Message, ToolSchema

log = logging.getLogger("ratchet.step")


class TaskEnded(Exception):
    """This message's work is over: the task reached a terminal state or was deferred."""


@dataclass(frozen=True)
class Context:
    """What a step needs, read once at its start."""

    lease: Lease
    task: Task
    agent: Agent
    tools: dict[str, Tool]
    history: list[Message]
    step_row: Step | None
    calls: dict[str, ToolCall]
    tenant_name: str


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


def advance(task_id: str, step: int | None = None) -> None:
    """Run one step of ``task_id`` if it is ours to run, then enqueue whatever comes next."""
    settings = get_settings()
    ttl_ms = int(settings.lease_ttl_seconds * 1000)
    with transaction() as session:
        lease = task_store.take_lease(
            session,
            task_id,
            owner=worker_id(),
            ttl_ms=ttl_ms,
            step=step,
            max_attempts=settings.max_step_attempts,
        )
    if isinstance(lease, LeaseRefused):
        log.info("no lease for %s: %s", task_id, lease.reason, extra={"task_id": task_id})
        if lease.retry_in_ms and step is not None:
            enqueue_step(task_id, step, delay_ms=lease.retry_in_ms + 100)
        return
    extra = {"task_id": task_id, "step": lease.step, "lease_epoch": lease.epoch}
    try:
        with heartbeat(lease):
            finished = run_step(lease)
    except LeaseLost as exc:
        log.warning("fenced: %s", exc, extra=extra)
        return
    except TaskEnded:
        return
    if not finished:
        enqueue_step(task_id, lease.step + 1)


@contextmanager
def heartbeat(lease: Lease) -> Iterator[None]:
    """Extend the lease in the background while a long model call or tool runs."""
    stop = threading.Event()
    interval = lease.ttl_ms / 3000

    def beat() -> None:
        while not stop.wait(interval):
            try:
                with transaction() as session:
                    task_store.fence(session, lease)
            except LeaseLost:
                return
            except Exception:
                log.exception("heartbeat failed", extra={"task_id": lease.task_id})

    thread = threading.Thread(target=beat, name=f"heartbeat-{lease.task_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextmanager
def fenced(lease: Lease) -> Iterator[Session]:
    """A transaction that holds the lease; a requested cancel ends the task right here."""
    with transaction() as session:
        if task_store.fence(session, lease):
            task_store.finish(
                session,
                lease,
                status=TaskStatus.CANCELLED,
                error={"type": "cancelled", "message": "cancelled at the client's request"},
            )
            cancelled = True
        else:
            cancelled = False
            yield session
    if cancelled:
        raise TaskEnded


def fail(lease: Lease, error_type: str, message: str) -> NoReturn:
    with fenced(lease) as session:
        task_store.finish(
            session, lease, status=TaskStatus.FAILED, error={"type": error_type, "message": message}
        )
    raise TaskEnded


def run_step(lease: Lease) -> bool:
    """Run ``lease.step``; return True when the task reached a terminal state."""
    ctx = load_context(lease)
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
        with fenced(lease) as session:
            complete_step(session, lease)
    failpoints.hit("after_step_commit")
    return False


def complete_step(session: Session, lease: Lease) -> None:
    """The step is done: mark it, move the task's progress on, free the lease."""
    checkpoints.complete_step(session, lease)
    task_store.commit_progress(session, lease)
    append_event(session, lease.task_id, "step.completed", {"step": lease.step})


def load_context(lease: Lease) -> Context:
    with transaction() as session:
        task = session.get(Task, lease.task_id, populate_existing=True)
        assert task is not None
        steps = checkpoints.load_steps(session, lease.task_id)
        calls = ledger.calls_for_task(session, lease.task_id)
        tenant_name = session.scalar(select(Tenant.name).where(Tenant.id == task.tenant_id))
    agent = get_agent(task.agent)
    registry = get_registry()
    tools = {name: registry.tools[name] for name in task.tools if name in registry.tools}
    done = [s for s in steps if s.number < lease.step]
    current = next((s for s in steps if s.number == lease.step), None)
    return Context(
        lease=lease,
        task=task,
        agent=agent,
        tools=tools,
        history=conversation(task, agent, done, calls),
        step_row=current,
        calls={c.call_id: c for c in calls if c.step_number == lease.step},
        tenant_name=tenant_name or task.tenant_id,
    )


def conversation(
    task: Task, agent: Agent, steps: Sequence[Step], calls: Sequence[ToolCall]
) -> list[Message]:
    """Rebuild the chat from the task's input, each step's response and the ledger."""
    system = "\n\n".join(p for p in (agent.system_prompt, task.instructions) if p)
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    if isinstance(task.input, str):
        messages.append({"role": "user", "content": task.input})
    else:
        messages.extend({"role": m["role"], "content": m["content"]} for m in task.input)
    by_step: dict[int, list[ToolCall]] = defaultdict(list)
    for call in calls:
        by_step[call.step_number].append(call)
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
    if lease.step > task.max_steps:
        fail(lease, "max_steps_exceeded", f"the task reached max_steps ({task.max_steps})")
    if task.deadline_ms is not None:
        with transaction() as session:
            clock = session.scalar(select(now_ms()))
        if clock is not None and clock > task.deadline_ms:
            fail(lease, "deadline_exceeded", "the task ran past its wall-clock deadline")
    if task.cancel_requested:
        with fenced(lease):
            pass


@dataclass(frozen=True)
class Answer:
    response: ModelResponse
    latency_ms: int
    started_at: datetime


def call_model(ctx: Context) -> Answer:
    """Ask the model for this step, retrying transient errors with full jitter."""
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
    failpoints.hit("model_call")
    try:
        response = model_calls.complete(
            provider,
            request,
            model=ctx.task.model,
            tenant=ctx.tenant_name,
            prior_failures=ctx.task.model_failures,
        )
    except ModelError as exc:
        fail(ctx.lease, exc.error_type, str(exc))
    except model_calls.Deferred as deferred:
        defer(ctx.lease, deferred)
    return Answer(response, int((time.monotonic() - started) * 1000), started_at)


def defer(lease: Lease, deferred: model_calls.Deferred) -> NoReturn:
    """Give the lease back and come back for this step after the wait, via the queue."""
    cap_ms = get_settings().visibility_timeout_seconds * 500  # never an ETA the broker redelivers
    delay_ms = min(int(deferred.delay_s * 1000), cap_ms)
    with fenced(lease) as session:
        task_store.release_lease(
            session,
            lease,
            delay_ms=delay_ms,
            model_failures=deferred.failures,
            waiting={**deferred.reason, "retry_in_ms": delay_ms},
        )
    log.info(
        "step waits %d ms via the queue: %s",
        delay_ms,
        deferred.reason,
        extra={"task_id": lease.task_id},
    )
    enqueue_step(lease.task_id, lease.step, delay_ms=delay_ms)
    raise TaskEnded


def record_response(ctx: Context, answer: Answer) -> bool:
    """Checkpoint the model's answer; a final answer (no tool calls) also ends the task."""
    response = answer.response
    lease, task = ctx.lease, ctx.task
    cost = cost_usd(
        task.model, input_tokens=response.input_tokens, output_tokens=response.output_tokens
    )
    call = checkpoints.ModelCall(
        response=response.to_dict(),
        input_tokens=response.input_tokens,
        output_tokens=response.output_tokens,
        cost_usd=cost,
        latency_ms=answer.latency_ms,
        started_at=answer.started_at,
    )
    over_budget = budget_exceeded(task, response.input_tokens + response.output_tokens, cost)
    with fenced(lease) as session:
        checkpoints.record_model_response(session, lease, call)
        task_store.add_usage(
            session,
            lease,
            input_tokens=response.input_tokens,
            output_tokens=response.output_tokens,
            cost_usd=cost,
        )
        usage = {
            "input_tokens": response.input_tokens,
            "output_tokens": response.output_tokens,
            "cost_usd": cost,
        }
        append_event(
            session,
            lease.task_id,
            "step.model_response",
            {"step": lease.step, **response.to_dict(), "usage": usage},
        )
        if over_budget:
            task_store.finish(
                session,
                lease,
                status=TaskStatus.FAILED,
                error={"type": "budget_exceeded", "message": over_budget},
            )
            return True
        if response.tool_calls:
            return False
        checkpoints.complete_step(session, lease)
        append_event(session, lease.task_id, "step.completed", {"step": lease.step})
        task_store.finish(
            session,
            lease,
            status=TaskStatus.SUCCEEDED,
            result={"output": response.content or ""},
            steps=lease.step,
        )
    return True


def budget_exceeded(task: Task, tokens: int, cost: float) -> str | None:
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
    call_id = f"{lease.step}-{position}"
    row = ctx.calls.get(call_id)
    if row is not None and row.status != ledger.STARTED:
        return False
    tool = ctx.tools.get(call.name)
    if row is None:
        with fenced(lease) as session:
            ledger.start_call(
                session,
                lease,
                position=position,
                call_id=call_id,
                provider_call_id=call.id,
                tool=call.name,
                arguments=call.arguments,
            )
    elif tool is not None and not tool.idempotent:
        resolve_unknown_outcome(ctx, tool, call_id)
        return False
    else:
        with fenced(lease) as session:
            ledger.restart_call(session, lease, call_id)
    failpoints.hit("tool_call")
    outcome = invoke(ctx, tool, call, call_id)
    failpoints.hit("after_tool")
    with fenced(lease) as session:
        record_outcome(session, lease, call_id=call_id, name=call.name, outcome=outcome)
        if last:
            complete_step(session, lease)
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
    context = ToolContext(
        task_id=ctx.task.id,
        tenant_id=ctx.task.tenant_id,
        call_id=call_id,
        idempotency_key=ledger.idempotency_key(ctx.task.id, call_id),
    )
    return tool_runner.execute(tool, call.arguments, context)


def record_outcome(
    session: Session, lease: Lease, *, call_id: str, name: str, outcome: tool_runner.Outcome
) -> None:
    status = ledger.SUCCEEDED if outcome.ok else ledger.FAILED
    ledger.finish_call(
        session, lease, call_id, status=status, result=outcome.result, error=outcome.error
    )
    append_event(
        session,
        lease.task_id,
        "step.tool_call",
        {
            "step": lease.step,
            "call_id": call_id,
            "name": name,
            "status": status,
            "result": outcome.result,
            "error": outcome.error,
        },
    )


def resolve_unknown_outcome(ctx: Context, tool: Tool, call_id: str) -> None:
    """A non-idempotent call was started but never finished: apply the tool's policy."""
    lease = ctx.lease
    message = (
        f"tool call {call_id} ({tool.name}) was interrupted by a crash; its outcome is unknown "
        "and the tool is not idempotent, so it was not run again"
    )
    unknown = tool_runner.Outcome(ok=False, error=message)
    with fenced(lease) as session:
        record_outcome(session, lease, call_id=call_id, name=tool.name, outcome=unknown)
        if tool.on_unknown_outcome == "tell_model":
            return
        task_store.finish(
            session,
            lease,
            status=TaskStatus.FAILED,
            error={"type": "tool_outcome_unknown", "message": message},
        )
    raise TaskEnded
