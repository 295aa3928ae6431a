"""Running one tool call: validated arguments, a time limit, and an outcome that is data."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from shared.agents.registry import Tool, ToolContext, get_registry
from shared.agents.waiting import Parking, Wait
from shared.errors import RatchetError, ToolOutcomeUnknown
from shared.settings import get_settings
from workers import cancels


@dataclass(frozen=True)
class Outcome:
    ok: bool
    result: Any = None
    error: str | None = None
    unknown: bool = False  # the call overran its limit and may still finish
    # The call parks: on a durable wait the tool raised, or on the child task it started.
    parking: Parking | None = None


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
    except Wait as wait:
        return Outcome(ok=False, parking=Parking.of(wait))
    except TimeoutError:
        return Outcome(ok=False, error=f"{tool.name} timed out after {limit:g} s", unknown=True)
    except ToolOutcomeUnknown as exc:  # e.g. an MCP server that died mid-call
        return Outcome(ok=False, error=storable_text(_text_of(exc)), unknown=True)
    except RatchetError as exc:
        return Outcome(ok=False, error=storable_text(_text_of(exc)))
    except Exception as exc:  # a tool's bug goes back to the model, it does not crash the task
        error = f"{tool.name} raised {type(exc).__name__}: {_text_of(exc)}"
        return Outcome(ok=False, error=storable_text(error))
    try:
        return Outcome(ok=True, result=as_json(result))
    except NotJSON as exc:
        error = f"{tool.name} returned a result that JSON cannot hold: {exc}"
        return Outcome(ok=False, error=storable_text(error))


class NotJSON(ValueError):
    """A value that JSON, or PostgreSQL's ``jsonb``, cannot hold."""


def as_json(value: Any) -> Any:
    """``value`` as it reads back from its JSON text: what the ledger, the event log and the
    model will all hold (a tuple becomes a list, an integer key a string).

    Raises :class:`NotJSON` for what the store would refuse after the tool has run: NaN or an
    infinity, an integer past Python's limit on its decimal text, an object that is not JSON,
    a cycle or nesting past the recursion limit, and a string holding a NUL character or a
    lone surrogate (``jsonb`` takes neither). Checked once, here, for every tool's result.
    """
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise NotJSON(_text_of(exc)) from exc
    if _NUL.search(text):
        raise NotJSON("a string holds a NUL character (\\u0000)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise NotJSON("a string holds a lone surrogate, which is not Unicode text") from exc
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise NotJSON("it nests too deeply") from exc


# JSON text escapes a NUL as \u0000; a backslash before it that is itself escaped (\\u0000,
# the six characters of a literal "\u0000") is not a NUL.
_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def storable_text(text: str) -> str:
    """``text`` as a text column and ``jsonb`` hold it: a NUL character and a lone surrogate
    spelled out as escapes, everything else unchanged."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def _text_of(exc: BaseException) -> str:
    """An exception's message, or a placeholder when making it fails in turn (its argument is
    an integer past the limit on decimal text)."""
    try:
        return str(exc)
    except Exception:
        return "a message that cannot be shown"


def message_content(
    *, ok: bool, result: Any, error: str | None, max_chars: int | None = None
) -> str:
    """What the model reads back for a call: at most ``max_chars`` of it (the ledger keeps
    the whole result; the model reads where it was cut, and how much was left out)."""
    if not ok:
        text = f"error: {error}"
    else:
        text = result if isinstance(result, str) else json.dumps(result)
    return text if max_chars is None else cut_text(text, max_chars)


def result_limit(tool_name: str, tools: Mapping[str, Tool] | None = None) -> int:
    """The most characters of a ``tool_name`` call's result the model reads: the tool's own
    ``max_result_chars`` (as ``tools``, a task's, define it, else the registry), else
    ``RATCHET_TOOL_RESULT_MAX_CHARS``."""
    tool = (tools or {}).get(tool_name) or get_registry().tools.get(tool_name)
    own = tool.max_result_chars if tool is not None else None
    return own or get_settings().tool_result_max_chars


def cut_text(text: str, max_chars: int) -> str:
    """``text`` if it has at most ``max_chars`` characters, else its start and its end (three
    quarters and a quarter of them) around a line that says how much was cut out there."""
    if len(text) <= max_chars:
        return text
    head = max_chars * 3 // 4
    tail = max_chars - head
    cut = len(text) - head - tail
    note = (
        f"\n[... {cut:,} of {len(text):,} characters cut out here to fit the prompt; "
        "the whole result is kept in the task's step timeline ...]\n"
    )
    return text[:head] + note + (text[-tail:] if tail else "")
