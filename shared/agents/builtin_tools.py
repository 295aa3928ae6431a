"""The built-in tools and the ``default`` agent, which may use all of them."""

from __future__ import annotations

import ast
import math
import operator
from datetime import UTC, datetime
from typing import Annotated, Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import httpx
from pydantic import Field

from shared.agents.registry import Agent, ToolContext, register_agent, tool
from shared.errors import ToolError
from shared.settings import get_settings
from shared.webhooks.egress import check_url, pinned_request

_BINARY: dict[type[ast.operator], Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Any] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Any] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "exp": math.exp,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "min": min,
    "max": max,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}
_MAX_EXPONENT = 10_000


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ToolError(f"exponent {right} is too large")
        return _BINARY[type(node.op)](left, right)  # type: ignore[no-any-return]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))  # type: ignore[no-any-return]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        return _FUNCTIONS[node.func.id](*(_evaluate(arg) for arg in node.args))  # type: ignore[no-any-return]
    raise ToolError(f"unsupported expression element: {ast.dump(node)[:60]}")


@tool(idempotent=True)
def calculator(expression: Annotated[str, Field(max_length=500)]) -> float | int:
    """Evaluate an arithmetic expression: + - * / // % **, parentheses, pi, e, and
    sqrt, abs, round, floor, ceil, log, exp, sin, cos, tan, min, max."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from exc
    try:
        return _evaluate(tree)
    except (ArithmeticError, ValueError, TypeError) as exc:
        raise ToolError(f"cannot evaluate {expression!r}: {exc}") from exc


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
    """Make an HTTP request and return its status, headers and body (text, first 64 KiB).

    Every call carries an ``Idempotency-Key`` header that stays the same if the call is
    re-sent after a crash, so a receiver that honours it performs the action once."""
    settings = get_settings()
    destination = check_url(
        url,
        allowed_hosts=settings.http_allowed_hosts,
        only_allowed=bool(settings.http_allowed_hosts),
    )
    sent_headers = {k: v for k, v in (headers or {}).items() if k.lower() != "idempotency-key"}
    sent_headers["Idempotency-Key"] = context.idempotency_key
    with httpx.Client(timeout=settings.tool_timeout_seconds, follow_redirects=False) as client:
        try:
            response = pinned_request(
                client, destination, method=method, headers=sent_headers, json=json
            )
        except httpx.HTTPError as exc:
            raise ToolError(f"{method} {url} failed: {type(exc).__name__}: {exc}") from exc
    return {
        "status": response.status_code,
        "headers": dict(response.headers),
        "body": response.text[:65536],
    }


register_agent(
    Agent(
        name="default",
        description="A general assistant with every built-in tool.",
        system_prompt="You are a helpful assistant. Use the tools when they help.",
        tools=("calculator", "current_time", "sleep", "http_request"),
    )
)
