"""Tool calls that wait for a person. When the model asks for one, the calls of the step that
need no approval run; then the ones that do are recorded in the ledger as ``awaiting``, in
the same write that puts the task in ``awaiting_approval`` and lets go of it: no lease, no
worker slot, no message. A decision (``shared.approvals``) puts the task back to run; the
step then runs each approved call (with its edited arguments, if edited) once, through the
ledger like any call, and tells the model about each rejected one."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from shared.agents.registry import Tool
from shared.approvals import links
from shared.settings import get_settings
from shared.store import ledger
from shared.store.batch import Part
from shared.store.ledger import CallStatus
from shared.store.step_write import await_approval
from workers.providers import ModelResponse, ToolCallRequest
from workers.steps.commits import TaskEnded, fenced
from workers.steps.context import Context


class AskAgain(Exception):
    """A call's run ended with its outcome unknown, and its tool asks a person whether to
    run it again: the step waits for that decision."""

    def __init__(self, call_id: str) -> None:
        super().__init__(call_id)
        self.call_id = call_id


def needs_approval(ctx: Context, call: ToolCallRequest) -> bool:
    """Whether this call waits for a person: its tool always asks, its predicate says so for
    these arguments, or the task's submission named the tool."""
    tool = ctx.tools.get(call.name)
    if tool is None or call.invalid_arguments is not None:
        return False  # it fails without running: nothing to approve
    listed = call.name in (ctx.task.approval or {}).get("tools", ())
    return listed or tool.needs_approval(call.arguments)


def find_waiting(ctx: Context, response: ModelResponse) -> list[int]:
    """Positions of the calls that still wait: new ones that need approval, recorded ones
    nobody has decided yet, and ones whose outcome a crash left unknown that ask a person."""
    return [p for p, call in enumerate(response.tool_calls) if _waits(ctx, p, call)]


def _waits(ctx: Context, position: int, call: ToolCallRequest) -> bool:
    row = ctx.calls.get(ledger.call_id(ctx.lease.step, position))
    if row is None:
        return needs_approval(ctx, call)
    undecided = row.status == CallStatus.AWAITING and row.decision is None
    return undecided or _ask_again(ctx, row)


def _ask_again(ctx: Context, row: Any) -> bool:
    """A call this step found ``started`` (its run's outcome is unknown: a crash), of a tool
    that is not idempotent and asks a person whether to run it again."""
    tool = ctx.tools.get(row.tool)
    return (
        row.status == CallStatus.STARTED
        and tool is not None
        and not tool.idempotent
        and tool.on_unknown_outcome == "ask"
    )


def _policy(ctx: Context, tool: Tool) -> tuple[float, str]:
    """How long a decision may take, and what happens then: the submission's choice, else the
    tool's, else the settings'."""
    task, settings = ctx.task.approval or {}, get_settings()
    timeout = (
        task.get("timeout_seconds") or tool.approval_timeout or settings.approval_timeout_seconds
    )
    on_timeout = task.get("on_timeout") or tool.on_approval_timeout or settings.approval_on_timeout
    return float(timeout), str(on_timeout)


def wait(
    ctx: Context,
    response: ModelResponse,
    positions: list[int],
    *,
    asked: frozenset[str] = frozenset(),
) -> None:
    """Record the calls that wait and put the task to wait for them, in one write; the step
    ends here (it completes once every call is settled). ``asked``: calls this step ran whose
    outcome is unknown, whose tool asks whether to run them again."""
    lease = ctx.lease
    new: list[Part] = []
    calls: list[dict[str, Any]] = []
    for position in positions:
        call = response.tool_calls[position]
        call_id = ledger.call_id(lease.step, position)
        row = ctx.calls.get(call_id)
        timeout, policy = _policy(ctx, ctx.tools[call.name])
        deadline_ms = ctx.clock_ms + int(timeout * 1000)
        if call_id in asked or (row is not None and _ask_again(ctx, row)):
            on_timeout = policy
            new.append(ledger.ask_again(call_id, deadline_ms=deadline_ms, on_timeout=policy))
        elif row is None:
            on_timeout = policy
            new.append(
                ledger.await_decision(
                    lease,
                    position=position,
                    call_id=call_id,
                    provider_call_id=call.id,
                    tool=call.name,
                    arguments=call.arguments,
                    deadline_ms=deadline_ms,
                    on_timeout=on_timeout,
                )
            )
        else:
            on_timeout = row.approval_on_timeout or policy
            if (row.approval_deadline_ms or 0) > ctx.clock_ms:
                deadline_ms = row.approval_deadline_ms or 0
            else:  # waiting again (a retried task): a new deadline, not the one that passed
                new.append(ledger.extend_wait(call_id, deadline_ms=deadline_ms))
        pending = _pending_call(ctx.task.id, call_id, call, deadline_ms, on_timeout)
        if call_id in asked or (row is not None and (row.runs or 0) > 0):
            pending["question"] = "its last run's outcome is unknown (a crash): run it again?"
        calls.append(pending)
    with fenced(ctx) as writes:
        writes.set(await_approval({"step": lease.step, "calls": calls}))
        writes.add(*new)
    raise TaskEnded


def _pending_call(
    task_id: str, call_id: str, call: ToolCallRequest, deadline_ms: int, on_timeout: str | None
) -> dict[str, Any]:
    deadline = datetime.fromtimestamp(deadline_ms / 1000, UTC).isoformat(timespec="seconds")
    pending = {
        "call_id": call_id,
        "tool": call.name,
        "arguments": call.arguments,
        "deadline": deadline,
        "on_timeout": on_timeout,
    }
    url = links.link(task_id, call_id, expires_ms=deadline_ms)
    return pending | ({"approval_url": url} if url else {})


def describe_rejection(row: Any) -> str:
    """What the model reads of a rejected call."""
    who = row.decided_by or "a person"
    why = f": {row.decision_reason}" if row.decision_reason else ""
    return f"the call was rejected by {who} and did not run{why}"
