"""The tool half of a step: each call the model asked for runs at most once per ledger row
(replayed if it finished before a crash, resolved by its policy if its outcome is unknown),
and its outcome is committed; the last one commits with the step's completion."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

from opentelemetry.trace import StatusCode

from shared import failpoints
from shared.agents.registry import Tool, ToolContext
from shared.observability import metrics, redaction, tracing
from shared.statuses import Decision, TaskStatus
from shared.store import checkpoints, ledger
from shared.store.batch import Part
from shared.store.events import tool_call_data
from shared.store.ledger import CallStatus
from shared.store.step_write import finish_task, log_events
from shared.vault import SecretsNotConfigured, SecretUnreadable
from workers import cancels, tool_runner, tool_secrets
from workers.providers import ToolCallRequest
from workers.steps import approval_waits, parking
from workers.steps.commits import TaskEnded, cancel, complete_current_step, fenced
from workers.steps.context import Context


def run_tool_call(ctx: Context, position: int, call: ToolCallRequest, *, last: bool) -> bool:
    """Run one call through the ledger: replay a finished call, decide about a started one.

    The last call's outcome commits together with the step's completion (one commit fewer);
    returns whether that happened.
    """
    lease = ctx.lease
    call_id = ledger.call_id(lease.step, position)
    row = ctx.calls.get(call_id)
    tool = ctx.tools.get(call.name)
    if (
        row is not None and row.status == CallStatus.AWAITING
    ):  # decided: see workers.steps.approval_waits
        if row.decision == Decision.REJECT:
            rejected = tool_runner.Outcome(ok=False, error=approval_waits.describe_rejection(row))
            finish = ledger.reject_call(call_id, error=rejected.error or "")
            record_outcome(
                ctx, call_id=call_id, name=call.name, outcome=rejected, last=last, finish=finish
            )
            return last
        call = replace(call, arguments=row.arguments)  # as approved, or as edited
        start: Part | None = ledger.start_approved_call(lease, call_id)
    elif row is not None and row.status == CallStatus.WAITING:  # see workers.steps.parking
        return resume_parked(ctx, call_id, call, last=last)
    elif row is not None and row.status != CallStatus.STARTED:
        return False
    elif row is not None and tool is not None and not tool.idempotent:
        return resolve_unknown_outcome(ctx, tool, call_id, last=last)
    elif row is None:
        start = None if call_id in ctx.started else _start_call(ctx, position, call)
    else:
        start = ledger.rerun(lease, call_id)
    if start is not None:
        with fenced(ctx) as writes:
            writes.add(start)
    failpoints.hit("tool_call")
    try:
        outcome = invoke(ctx, tool, call, call_id)
    except cancels.Interrupted:
        abandoned = (
            "the task was cancelled while the call ran: stopped, or abandoned if it could not be"
        )
        cancel(
            ctx, ledger.finish_call(call_id, status=CallStatus.FAILED, result=None, error=abandoned)
        )
    failpoints.hit("after_tool")
    if outcome.parking is not None:
        parking.park_call(ctx, position, call, outcome.parking)
    if outcome.unknown and tool is not None and not tool.idempotent:
        # An abandoned call may still act (a killed one cannot): as after a crash, the
        # tool's policy decides.
        why = f"{outcome.error}" + ("" if outcome.stopped else "; it may still complete")
        return resolve_unknown_outcome(ctx, tool, call_id, why=why, last=last)
    record_outcome(ctx, call_id=call_id, name=call.name, outcome=outcome, last=last)
    return last


def resume_parked(ctx: Context, call_id: str, call: ToolCallRequest, *, last: bool) -> bool:
    """A parked call: its outcome from its settled wait, committed (with the step's
    completion if ``last``); Parked while its wait is pending."""
    settled = parking.settled_outcome(ctx, call_id)
    if settled is None:
        raise parking.Parked(call_id)
    failpoints.hit("resume_parked")
    finish = ledger.finish_waiting_call(
        call_id,
        status=CallStatus.SUCCEEDED if settled.ok else CallStatus.FAILED,
        result=settled.result,
        error=settled.error,
    )
    record_outcome(ctx, call_id=call_id, name=call.name, outcome=settled, last=last, finish=finish)
    return last


def _start_call(ctx: Context, position: int, call: ToolCallRequest) -> Part:
    return ledger.start_call(
        ctx.lease,
        position=position,
        call_id=ledger.call_id(ctx.lease.step, position),
        provider_call_id=call.id,
        tool=call.name,
        arguments=call.arguments,
    )


def start_with_response(ctx: Context, calls: list[ToolCallRequest]) -> Part | None:
    """The ``started`` row of the answer's first call, to commit with the answer itself, if
    that call will run at once and may run again: a known idempotent tool, its arguments
    valid, no approval to wait for. One write fewer per tool step. Were the worker to die
    between that commit and the call, the resumed step finds the call ``started`` and runs
    it again, as an idempotent call is after any crash. (Any other call's row is written
    just before it runs: its ``started`` says it may have run.) Notes the call in
    ``ctx.started``, so that it is not started a second time."""
    if not calls:
        return None
    call, call_id = calls[0], ledger.call_id(ctx.lease.step, 0)
    tool = ctx.tools.get(call.name)
    if tool is None or not tool.idempotent or call_id in ctx.calls:
        return None
    if call.invalid_arguments is not None or approval_waits.needs_approval(ctx, call):
        return None
    ctx.started.add(call_id)
    return _start_call(ctx, 0, call)


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
    if tool.agent is not None:  # a sub-agent: its child task, not a function, does the work
        started: tool_runner.Outcome = parking.start_subagent(ctx, call, call_id, tool)
        return started
    try:
        secrets = tool_secrets.for_call(ctx.task.tenant_id, tool)
    except (SecretsNotConfigured, SecretUnreadable) as exc:
        return tool_runner.Outcome(ok=False, error=f"{tool.name} cannot run: {exc}")
    watch = cancels.current()
    context = ToolContext(
        task_id=ctx.task.id,
        tenant_id=ctx.task.tenant_id,
        call_id=call_id,
        idempotency_key=ledger.idempotency_key(ctx.task.id, call_id),
        cancelled=watch.cancelled if watch is not None else threading.Event(),
        secrets=secrets,
    )
    with tracing.tool_span(tool.name, call_id=call_id) as span, redaction.in_flight(secrets):
        # Redacted before anything stores or shows it: the ledger, events, the model, spans.
        outcome = tool_secrets.redacted(tool_runner.execute(tool, call.arguments, context), secrets)
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
    finish: Part | None = None,
) -> None:
    """Commit a call's outcome; with ``last`` the step completes in the same write, with
    ``end_task`` (an error) the task fails in it. ``finish``: the ledger's change, if not
    the outcome of a started call (a rejection)."""
    lease = ctx.lease
    ctx.outcomes[call_id] = outcome
    status = CallStatus.SUCCEEDED if outcome.ok else CallStatus.FAILED
    metrics.tool_calls.labels(tool=name if name in ctx.tools else "unknown", status=status).inc()
    finish = finish or ledger.finish_call(
        call_id, status=status, result=outcome.result, error=outcome.error
    )
    # The event says what the ledger's row will hold (reads of the log rebuild it from there).
    written = finish.values
    event = tool_call_data(
        lease.step,
        call_id,
        name=name,
        status=written["status"],
        result=written.get("result"),
        error=written.get("error"),
    )
    change = log_events(("step.tool_call", event))
    if end_task is not None:
        change = change.then(finish_task(TaskStatus.FAILED, error=end_task))
    elif last:
        change = change.then(complete_current_step(ctx))
    with fenced(ctx) as writes:
        writes.set(change)
        writes.add(finish)
        if last and end_task is None:
            writes.add(checkpoints.complete_checkpoint(lease))


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
    if tool.on_unknown_outcome == "ask":
        raise approval_waits.AskAgain(call_id)
    if tool.on_unknown_outcome == "tell_model":
        record_outcome(ctx, call_id=call_id, name=tool.name, outcome=unknown, last=last)
        return last
    error = {"type": "tool_outcome_unknown", "message": message}
    record_outcome(
        ctx, call_id=call_id, name=tool.name, outcome=unknown, last=False, end_task=error
    )
    raise TaskEnded
