"""The model half of a step: check the budget and limits, call the model (through the
rate limiter, retrying what is transient), and commit its response before any tool runs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial
from typing import Any, NoReturn

from opentelemetry.trace import StatusCode

from shared import failpoints
from shared.errors import ModelError
from shared.model_strings import parse_model
from shared.observability import tracing
from shared.pricing import cost_usd, worst_case_cost
from shared.settings import get_settings
from shared.statuses import TaskStatus
from shared.store import checkpoints
from shared.store.events import model_response_data
from shared.store.step_write import (
    CANCELLED_ERROR,
    TaskWrite,
    add_usage,
    finish_task,
    log_events,
    release,
)
from shared.store.tables import utcnow
from shared.views import TaskState
from workers import cancels, heartbeat, model_calls, tokens
from workers.gatherer import Live
from workers.providers import ModelRequest, ModelResponse, get_provider
from workers.providers.base import ToolSchema, answer_cap
from workers.steps import output, window
from workers.steps.commits import TaskEnded, cancel, fail, fenced
from workers.steps.context import Context
from workers.steps.prompt import ContextExceeded, Prompt, prompt_for
from workers.steps.tools import start_with_response
from workers.tool_runner import storable_text

log = logging.getLogger("ratchet.step")


KEPT_ATTEMPTS = 20  # failed model calls of a step kept for its timeline (the latest)


def check_limits(ctx: Context) -> None:
    """Limits checked before each model call; each ends the task with the reason."""
    task, lease = ctx.task, ctx.lease
    if task.cancel_requested_at is not None:
        with fenced(ctx) as writes:
            writes.set(finish_task(TaskStatus.CANCELLED, error=CANCELLED_ERROR))
        raise TaskEnded
    if lease.step > task.max_steps:
        fail(ctx, "max_steps_exceeded", f"the task reached max_steps ({task.max_steps})")
    if task.deadline_ms is not None and ctx.clock_ms > task.deadline_ms:
        fail(ctx, "deadline_exceeded", "the task ran past its wall-clock deadline")
    if task.children_input_tokens or task.children_cost_usd:  # its sub-agents spent some
        over = budget_exceeded(task, 0, 0.0)
        if over:
            fail(ctx, "budget_exceeded", f"{over} (its sub-agents' usage included)")


@dataclass(frozen=True)
class Answer:
    response: ModelResponse
    latency_ms: int
    started_at: datetime
    prompt_tokens: int = 0  # the prompt as sent: the provider's count, else Ratchet's


def call_model(ctx: Context) -> Answer:
    """Ask the model for this step (rate limits, retries and 429 feedback included), with
    the conversation kept inside the model's window by the task's context policy."""
    provider, model_name = get_provider(ctx.task.model)
    tools = [ToolSchema(t.name, t.description, t.parameters_schema) for t in ctx.tools.values()]
    sent = fitted_prompt(ctx, tools)
    request = ModelRequest(
        task_id=ctx.task.id,
        step=ctx.lease.step,
        model=model_name,
        messages=sent.messages,
        tools=tools,
        options=ctx.task.model_options,
        output_schema=ctx.task.output_schema,
    )
    over_budget = budget_before_call(ctx.task, request)
    if over_budget:
        fail(ctx, "budget_exceeded", over_budget)
    started_at, started = utcnow(), time.monotonic()
    # This step's failed calls so far (earlier messages' too): the timeline shows them.
    failed = list((ctx.task.waiting or {}).get("model_attempts", []))
    failpoints.hit("model_call")
    with tracing.model_span(ctx.task.model) as span:
        try:
            # Each attempt waits on the model pool, within its deadline; the waits between
            # attempts give up the step's turn. A cancel cuts either short.
            response = model_calls.complete(
                provider,
                request,
                model=ctx.task.model,
                tenant=ctx.tenant_name,
                prior_failures=ctx.task.model_failures,
                failed=failed,
                still_held=partial(heartbeat.holding, ctx.lease),
                live=live_view(ctx),
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
                "gen_ai.usage.cache_read.input_tokens": response.cached_input_tokens,
                "gen_ai.usage.cache_creation.input_tokens": response.cache_write_tokens,
                "gen_ai.usage.reasoning.output_tokens": response.reasoning_tokens,
            }
        )
    checked = output.review(ctx.task, storable(response))
    window.observe(ctx.task.model, counted=sent.tokens, reported=response.input_tokens)
    latency_ms = int((time.monotonic() - started) * 1000)
    return Answer(checked, latency_ms, started_at, response.input_tokens or sent.tokens)


def live_view(ctx: Context) -> Live | None:
    """The live view of this step's model call, if it streams: the task's ``stream``, else
    its agent's, else ``RATCHET_STREAM_DEFAULT``."""
    chosen = ctx.task.stream if ctx.task.stream is not None else ctx.agent.stream
    if not (get_settings().stream_default if chosen is None else chosen):
        return None
    lease = ctx.lease
    return Live(lease.task_id, lease.step, lease.epoch, after=ctx.task.last_event_seq)


def fitted_prompt(ctx: Context, tools: list[ToolSchema]) -> Prompt:
    """The conversation as this call sends it, inside the model's window
    (``workers.steps.prompt``). A summary's model call, made first, ends the step as the
    step's own call would: cancelled, failed or deferred."""
    try:
        return prompt_for(ctx, tools)
    except ContextExceeded as exc:
        fail(ctx, "context_length_exceeded", str(exc))
    except cancels.Interrupted:
        cancel(ctx)
    except ModelError as exc:
        fail(ctx, exc.error_type, f"the summary of the conversation failed: {exc}")
    except model_calls.Deferred as deferred:
        defer(ctx, deferred, failed=[])


def storable(response: ModelResponse) -> ModelResponse:
    """The answer as the store holds it: a NUL character or a lone surrogate that the model
    wrote (PostgreSQL's ``jsonb`` takes neither, and a model can be talked into writing one)
    spelled out as an escape, in its text and in its tool calls' ids, names and arguments, rather
    than a checkpoint that fails on every attempt."""
    return replace(
        response,
        content=None if response.content is None else storable_text(response.content),
        tool_calls=[
            replace(
                call,
                id=storable_text(call.id),
                name=storable_text(call.name),
                arguments=_storable_value(call.arguments),
                invalid_arguments=None
                if call.invalid_arguments is None
                else storable_text(call.invalid_arguments),
            )
            for call in response.tool_calls
        ],
        thinking=_storable_value(response.thinking),
    )


def _storable_value(value: Any) -> Any:
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable_text(str(k)): _storable_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_storable_value(item) for item in value]
    return value


def defer(
    ctx: Context, deferred: model_calls.Deferred, *, failed: list[dict[str, Any]]
) -> NoReturn:
    """Give the lease back (and the task's concurrency slots) and come back for this step
    after the wait: the task waits in the backlog until it is due, and the dispatcher admits
    it again."""
    lease = ctx.lease
    cap_ms = get_settings().visibility_timeout_seconds * 500  # never an ETA the broker redelivers
    delay_ms = min(int(deferred.delay_s * 1000), cap_ms)
    waiting = {**deferred.reason, "retry_in_ms": delay_ms, "model_attempts": failed}
    with fenced(ctx) as writes:
        writes.set(
            release(lease, delay_ms=delay_ms, model_failures=deferred.failures, waiting=waiting)
        )
    log.info(
        "step waits %d ms in the backlog: %s",
        delay_ms,
        deferred.reason,
        extra={"task_id": lease.task_id},
    )
    raise TaskEnded


def record_response(ctx: Context, answer: Answer) -> bool:
    """Checkpoint the model's answer in one write; a final answer (no tool calls) or a blown
    budget also ends the task there. Returns whether the task ended."""
    response, lease, task = answer.response, ctx.lease, ctx.task
    details = usage_details(response)
    # An unpriced model's call is recorded at $0 and read back as unknown (``views.usage_of``).
    cost = cost_usd(
        task.model,
        input_tokens=response.input_tokens,
        output_tokens=response.output_tokens,
        cached_input_tokens=response.cached_input_tokens,
        cache_write_tokens=response.cache_write_tokens,
    )
    cost = cost or 0.0
    change = add_usage(
        input_tokens=response.input_tokens,
        output_tokens=response.output_tokens,
        cost_usd=cost,
        **details,
    ).then(log_events(("step.model_response", _response_event(lease.step, answer, cost))))
    over_budget = budget_exceeded(task, response.input_tokens + response.output_tokens, cost)
    # An answer that misses the output schema is a step of its own (the model tries again),
    # unless it was the last try.
    invalid = None if over_budget else output.failure(response, ctx.history)
    final = not response.tool_calls and not over_budget and response.output_error is None
    if over_budget or final or invalid:
        change = change.then(
            _ending(lease.step, task, response, over_budget=over_budget, invalid=invalid)
        )
    call = checkpoints.ModelCall(
        response=response.to_dict(),
        input_tokens=response.input_tokens,
        output_tokens=response.output_tokens,
        cost_usd=cost,
        latency_ms=answer.latency_ms,
        started_at=answer.started_at,
        prompt_tokens=answer.prompt_tokens,
        **details,
    )
    first = None if final or over_budget else start_with_response(ctx, response.tool_calls)
    with fenced(ctx) as writes:
        writes.set(change)
        writes.add(checkpoints.save_model_response(lease, call, final=final))
        if first is not None:
            writes.add(first)
    return final or bool(over_budget) or bool(invalid)


def _response_event(step: int, answer: Answer, cost: float) -> dict[str, Any]:
    """The ``step.model_response`` event (see ``events.model_response_data``)."""
    response = answer.response
    return model_response_data(
        step,
        response.to_dict(),
        input_tokens=response.input_tokens,
        output_tokens=response.output_tokens,
        cost_usd=cost,
        prompt_tokens=answer.prompt_tokens,
        **usage_details(response),
    )


def usage_details(response: ModelResponse) -> dict[str, int]:
    """The counts within the answer's tokens, as the step and the task record them."""
    return {
        "cached_input_tokens": response.cached_input_tokens,
        "cache_write_tokens": response.cache_write_tokens,
        "reasoning_tokens": response.reasoning_tokens,
    }


def _ending(
    step: int,
    task: TaskState,
    response: ModelResponse,
    *,
    over_budget: str | None,
    invalid: str | None,
) -> TaskWrite:
    """What ends the task with this answer: failed over its budget, or with an answer that
    missed its output schema on the last try; or the step completed and the task succeeded
    with the answer as its output (its text, or the JSON value it parsed as)."""
    if over_budget:
        return finish_task(
            TaskStatus.FAILED, error={"type": "budget_exceeded", "message": over_budget}
        )
    if invalid:
        return finish_task(TaskStatus.FAILED, error={"type": "invalid_output", "message": invalid})
    result = {"output": output.result_output(task, response.content)}
    return log_events(("step.completed", {"step": step})).then(
        finish_task(TaskStatus.SUCCEEDED, result=result, steps=step)
    )


def budget_before_call(task: TaskState, request: ModelRequest) -> str | None:
    """Why the task may not make this call: the worst it could use (its prompt, counted as the
    rate limiter counts it, and all the answer may take: ``answer_cap``) would take it past
    its budget. So a task stops before the call that could cross its budget, never a whole
    call past it. The scripted model is left to the check after the call: its usage is
    whatever its script says."""
    budget = task.budget or {}
    max_tokens, max_cost = budget.get("max_tokens"), budget.get("max_cost_usd")
    if (max_tokens is None and max_cost is None) or parse_model(task.model)[0] == "scripted":
        return None
    output = answer_cap(request.options)
    prompt = tokens.request_tokens(replace(request, options={}), task.model, default_output=0)
    children = (task.children_input_tokens or 0) + (task.children_output_tokens or 0)
    total_tokens = task.input_tokens + task.output_tokens + children + prompt + output
    if max_tokens is not None and total_tokens > max_tokens:
        return (
            f"the next model call could take the task to {total_tokens} tokens (a prompt of "
            f"about {prompt} and up to {output} for the answer), over its budget of {max_tokens}"
        )
    cost = worst_case_cost(task.model, prompt_tokens=prompt, output_tokens=output)
    total_cost = round(task.cost_usd + (task.children_cost_usd or 0.0) + (cost or 0.0), 9)
    if max_cost is not None and total_cost > max_cost:
        return (
            f"the next model call could take the task to ${total_cost:.4f} (a prompt of about "
            f"{prompt} tokens and up to {output} for the answer), over its budget of ${max_cost}"
        )
    return None


def budget_exceeded(task: TaskState, tokens: int, cost: float) -> str | None:
    budget = task.budget or {}
    max_tokens, max_cost = budget.get("max_tokens"), budget.get("max_cost_usd")
    # What its settled sub-agents used counts: the root's budget bounds its whole tree.
    children = (task.children_input_tokens or 0) + (task.children_output_tokens or 0)
    total_tokens = task.input_tokens + task.output_tokens + children + tokens
    if max_tokens is not None and total_tokens > max_tokens:
        return f"the task used {total_tokens} tokens, over its budget of {max_tokens}"
    # Rounded: costs are sums of small floats, and $0.10 + $0.20 is not over a $0.30 budget.
    total_cost = round(task.cost_usd + (task.children_cost_usd or 0.0) + cost, 9)
    if max_cost is not None and total_cost > max_cost:
        return f"the task cost ${total_cost:.4f}, over its budget of ${max_cost}"
    return None
