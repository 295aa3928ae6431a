"""The built-in tools and the ``default`` agent, which may use all of them."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field

from shared.agents import http_exchange
from shared.agents.calculator import MAX_EXPRESSION_LENGTH, evaluate
from shared.agents.registry import Agent, ToolContext, register_agent, tool
from shared.agents.waiting import Wait
from shared.errors import SandboxUnavailable, ToolError
from shared.sandbox import host, runs, workspaces
from shared.settings import get_settings
from shared.webhooks.egress import check_url


@tool(idempotent=True)
def calculator(expression: Annotated[str, Field(max_length=MAX_EXPRESSION_LENGTH)]) -> float | int:
    """Evaluate an arithmetic expression: + - * / // % **, parentheses, pi, e, and
    sqrt, abs, round, floor, ceil, log, exp, sin, cos, tan, min, max. Integers are exact up
    to 10,000 bits (about 3,000 digits); a larger or overflowing result is an error."""
    return evaluate(expression)


@tool(idempotent=True)
def current_time(timezone: str = "UTC") -> str:
    """The current date and time as ISO 8601 in the given IANA time zone (default UTC)."""
    try:
        zone = ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ToolError(f"unknown time zone {timezone!r}") from exc
    return datetime.now(UTC).astimezone(zone).isoformat()


@tool(idempotent=True)
def sleep(seconds: Annotated[float, Field(ge=0, le=600)], context: ToolContext) -> str:
    """Wait for the given number of seconds, then return."""
    if context.cancelled.wait(seconds):
        return "cancelled"
    return f"slept {seconds} s"


@tool(idempotent=True)
def http_request(
    url: Annotated[str, Field(max_length=2048)],
    context: ToolContext,
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"] = "GET",
    headers: dict[str, str] | None = None,
    json: Any = None,
) -> dict[str, Any]:
    """Make an HTTP request and return its status, headers and body (text, first 64 KiB;
    ``truncated`` says whether there was more).

    Every call carries an ``Idempotency-Key`` header that stays the same if the call is
    re-sent after a crash, so a receiver that honours it performs the action once. A
    ``Host`` header is not forwarded. The whole exchange, not each read, must complete within
    the tool's time limit."""
    settings = get_settings()
    destination = check_url(
        url,
        allowed_hosts=settings.http_allowed_hosts,
        only_allowed=bool(settings.http_allowed_hosts),
    )
    reply = http_exchange.exchange(
        destination,
        method=method,
        headers=http_exchange.outgoing_headers(headers, idempotency_key=context.idempotency_key),
        json=json,
        seconds=settings.tool_timeout_seconds,
    )
    return reply.to_dict()


@tool(idempotent=True)
def ask_user(
    question: Annotated[str, Field(min_length=1, max_length=4000)],
    timeout_seconds: Annotated[float | None, Field(gt=0, le=30 * 86_400)] = None,
) -> Any:
    """Ask the person who gave you this task a question, and wait for their answer (the
    task waits, for hours if need be). Ask only what you cannot find out or decide yourself.
    The answer is this call's result; if none comes in time, the result says so."""
    raise Wait({"question": question}, timeout_seconds=timeout_seconds, on_timeout="tell_model")


@tool(idempotent=True)  # its only effects are on the task's own workspace
def run_python(
    code: Annotated[str, Field(min_length=1, max_length=100_000)], context: ToolContext
) -> dict[str, Any]:
    """Run a Python 3 program (the standard library) in a sandbox and return its exit_code,
    stdout, stderr, whether it timed_out or its output was truncated, and the files in its
    working directory. print() what you want to read. There is no network. The working
    directory is this task's workspace: files written there are still there for the next
    run_python call of this task; nothing else on the machine is writable. Runs are limited
    in time, CPU, memory, processes, output and file size."""
    sandbox = host.check()
    if sandbox.launcher is None:
        raise SandboxUnavailable(sandbox.reason)
    result = runs.run(
        sandbox.launcher,
        code,
        workspace=workspaces.open_workspace(context.task_id),
        limits=runs.Limits.from_settings(get_settings()),
        cancelled=context.cancelled,
    )
    return result.to_dict()


register_agent(
    Agent(
        name="default",
        description="A general assistant with every built-in tool.",
        system_prompt="You are a helpful assistant. Use the tools when they help.",
        tools=("calculator", "current_time", "sleep", "http_request", "ask_user", "run_python"),
    )
)
