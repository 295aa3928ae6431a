"""Running one tool call: validated arguments, a time limit, and an outcome that is data."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any

from shared.agents.registry import Tool, ToolContext
from shared.errors import RatchetError
from shared.settings import get_settings
from workers import cancels


@dataclass(frozen=True)
class Outcome:
    ok: bool
    result: Any = None
    error: str | None = None
    unknown: bool = False  # the call overran its limit and may still finish


def execute(tool: Tool, arguments: dict[str, Any], context: ToolContext) -> Outcome:
    """Run ``tool``; any failure (bad arguments, an exception, the time limit) is an Outcome.

    A call that overruns its limit is abandoned, not killed: Python cannot stop a thread, so
    tools that can block for long should take their own timeouts too (``http_request`` does).
    A cancel of the task abandons it the same way and raises :class:`cancels.Interrupted`.
    """
    limit = tool.timeout or get_settings().tool_timeout_seconds
    try:
        result = cancels.call(
            partial(tool.invoke, arguments, context), timeout=limit, name=f"tool-{tool.name}"
        )
    except cancels.Interrupted:
        raise
    except TimeoutError:
        return Outcome(ok=False, error=f"{tool.name} timed out after {limit:g} s", unknown=True)
    except RatchetError as exc:
        return Outcome(ok=False, error=str(exc))
    except Exception as exc:  # a tool's bug goes back to the model, it does not crash the task
        return Outcome(ok=False, error=f"{tool.name} raised {type(exc).__name__}: {exc}")
    return Outcome(ok=True, result=_jsonable(result))


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def message_content(*, ok: bool, result: Any, error: str | None) -> str:
    """What the model reads back for a call."""
    if not ok:
        return f"error: {error}"
    return result if isinstance(result, str) else json.dumps(result)
