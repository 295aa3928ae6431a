"""Tool calls that park: a durable wait a tool raised (``ratchet.Wait``), or a sub-agent
call's child task. Such a call is committed ``waiting`` with its wait's row, as it finishes;
once the step's other calls have run, the task parks (``waiting``: no lease, no slot, no
worker) in one write, until every wait is settled (``shared.actions.waits``). Then a step
resumes it, takes each parked call's outcome from its settled wait, and goes on: nothing the
step committed runs again, and a child is never started twice (it is keyed by its call)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any, NoReturn

from shared import failpoints
from shared.actions import effects, families
from shared.actions import waits as wait_actions
from shared.agents.registry import Tool
from shared.agents.waiting import Parking
from shared.approvals import links
from shared.errors import ToolError
from shared.settings import get_settings
from shared.store import ledger
from shared.store import waits as store
from shared.store.db import get_sessionmaker
from shared.store.events import tool_call_data
from shared.store.step_write import await_waits, log_events
from shared.store.waits import WaitStatus
from workers import tool_runner
from workers.providers import ModelResponse, ToolCallRequest
from workers.steps.commits import TaskEnded, fenced, send_here
from workers.steps.context import Context

log = logging.getLogger("ratchet.step")


class Parked(Exception):
    """The call is parked on a pending wait: the step parks once its other calls ran."""

    def __init__(self, call_id: str) -> None:
        super().__init__(call_id)
        self.call_id = call_id


def start_subagent(ctx: Context, call: ToolCallRequest, call_id: str, tool: Tool) -> Any:
    """Start (or find) the child task of a sub-agent call: the outcome parks on it, or is
    the error the model reads (too deep, the task being cancelled)."""
    assert tool.agent is not None
    try:
        arguments = tool.validate_arguments(call.arguments)
        with get_sessionmaker()() as session:
            child_id, started = families.start_child(
                session,
                ctx.task,
                call_id=call_id,
                agent=tool.agent,
                task=arguments["task"],
                siblings=ctx.subagent_calls,
            )
    except ToolError as exc:
        return tool_runner.Outcome(ok=False, error=str(exc))
    effects.after_commit(started, send_webhooks=send_here)
    failpoints.hit("after_child_start")
    return tool_runner.Outcome(ok=False, parking=Parking(child_id=child_id))


def park_call(ctx: Context, position: int, call: ToolCallRequest, parking: Parking) -> NoReturn:
    """Commit the call as parked, with its wait's row; raises Parked."""
    lease, settings = ctx.lease, get_settings()
    call_id = ledger.call_id(lease.step, position)
    deadline_ms = None
    if parking.kind == "token":
        seconds = parking.timeout_seconds or settings.wait_timeout_seconds
        deadline_ms = ctx.clock_ms + int(seconds * 1000)
        if ctx.task.deadline_ms is not None:  # the task's own deadline runs while it waits
            deadline_ms = min(deadline_ms, ctx.task.deadline_ms)
    on_timeout = parking.on_timeout or settings.wait_on_timeout
    token = store.new_token()
    row = store.park(
        lease,
        token=token,
        call_id=call_id,
        tenant_id=ctx.task.tenant_id,
        parking=parking,
        deadline_ms=deadline_ms,
        on_timeout=on_timeout,
    )
    shown = public_wait(row.values, tool=call.name)
    event = tool_call_data(
        lease.step, call_id, name=call.name, status="waiting", result=None, error=None
    ) | {"wait": shown}
    with fenced(ctx) as writes:
        writes.set(log_events(("step.tool_call", event)))
        writes.add(ledger.park_call(call_id), row)
    ctx.parked[call_id] = shown
    raise Parked(call_id)


def public_wait(row: dict[str, Any], *, tool: str) -> dict[str, Any]:
    """A wait as the task's ``waiting``, its events and ``/steps`` show it; a token wait's
    signed URL (completes it without a key) when links are on."""
    shown = store.public(row) | {"tool": tool}
    if row["deadline_ms"] is not None:
        at = datetime.fromtimestamp(row["deadline_ms"] / 1000, UTC)
        shown["deadline"] = at.isoformat(timespec="seconds")
    if row["kind"] == "token":
        url = links.wait_link(row["token"])
        if url is not None:
            shown["url"] = url
    return shown


def settled_outcome(ctx: Context, call_id: str) -> tool_runner.Outcome | None:
    """A parked call's outcome from its settled wait; None while the wait is pending."""
    wait = ctx.waits.get(call_id)
    if wait is None or wait.status == WaitStatus.PENDING:
        return None
    if wait.status == WaitStatus.COMPLETED:
        return tool_runner.Outcome(ok=True, result=wait.payload)
    if wait.status == WaitStatus.EXPIRED and wait.error is None:  # tell_model
        return tool_runner.Outcome(ok=True, result=wait.payload)
    return tool_runner.Outcome(ok=False, error=wait.error or f"the wait was {wait.status}")


def park_task(ctx: Context, response: ModelResponse, call_ids: list[str]) -> NoReturn:
    """Park the task on the step's pending waits, in one write; then settle what settled
    while the step still held it (a child that ended, a completion), resuming it if nothing
    is left pending. The step ends here."""
    lease = ctx.lease
    pending = [ctx.parked[c] for c in call_ids if c in ctx.parked]
    pending += [_shown(ctx, c) for c in call_ids if c not in ctx.parked]
    with fenced(ctx) as writes:
        writes.set(await_waits({"step": lease.step, "waits": pending}))
    failpoints.hit("after_park")
    with get_sessionmaker()() as session:
        resumed = wait_actions.after_parking(session, lease.task_id)
    effects.after_commit(resumed, send_webhooks=send_here)
    raise TaskEnded


def _shown(ctx: Context, call_id: str) -> dict[str, Any]:
    wait = ctx.waits[call_id]
    row = {c: getattr(wait, c) for c in ("token", "call_id", "kind", "child_id", "status")}
    row |= {"request": wait.request, "deadline_ms": wait.deadline_ms, "on_timeout": wait.on_timeout}
    call = ctx.calls.get(call_id)
    return public_wait(row, tool=call.tool if call is not None else "")
