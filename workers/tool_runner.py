"""Running one tool call: validated arguments, a time limit, and an outcome that is data."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from shared.agents.registry import Tool, ToolContext, get_registry
from shared.agents.waiting import Parking, Wait
from shared.errors import RatchetError, ToolOutcomeUnknown
from shared.settings import get_settings
from workers import cancels, tool_processes


@dataclass(frozen=True)
class Outcome:
    ok: bool
    result: Any = None
    error: str | None = None
    unknown: bool = False  # the call may have acted, or not: it overran its limit or crashed
    # The call parks: on a durable wait the tool raised, or on the child task it started.
    parking: Parking | None = None
    # The call was stopped for good (its tool process killed): whatever it did before, it
    # does nothing more. An unknown outcome without it may still land (an abandoned thread).
    stopped: bool = False

    def to_wire(self) -> dict[str, Any]:
        """As JSON: what a tool process sends back for its call."""
        parking = None if self.parking is None else asdict(self.parking)
        return {
            "ok": self.ok,
            "result": self.result,
            "error": self.error,
            "unknown": self.unknown,
            "parking": parking,
            "stopped": self.stopped,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Outcome:
        parking = data.get("parking")
        fields = {**data, "parking": Parking(**parking) if parking else None}
        return cls(**fields)


def execute(tool: Tool, arguments: dict[str, Any], context: ToolContext) -> Outcome:
    """Run ``tool``; any failure (bad arguments, an exception, the time limit) is an Outcome.

    An isolated tool (``isolation="process"``, or ``RATCHET_TOOL_ISOLATION``) runs in a tool
    process, killed at its limit or on a cancel of the task (see ``workers.tool_processes``).
    Any other call runs on a thread, and one that overruns its limit is abandoned, not
    killed: Python cannot stop a thread, so tools that can block for long should take their
    own timeouts too (``http_request`` does). A cancel of the task abandons it the same way
    and raises :class:`cancels.Interrupted`.
    """
    limit = tool.timeout or get_settings().tool_timeout_seconds
    if isolated(tool):
        return _execute_in_process(tool, arguments, context, limit=limit)
    try:
        result = cancels.call(
            partial(tool.invoke, arguments, context), timeout=limit, name=f"tool-{tool.name}"
        )
    except cancels.Interrupted:
        raise
    except TimeoutError:
        return Outcome(ok=False, error=f"{tool.name} timed out after {limit:g} s", unknown=True)
    except Exception as exc:
        return failed(tool.name, exc)
    return succeeded(tool.name, result)


def isolated(tool: Tool) -> bool:
    """Whether ``tool``'s calls run in a tool process: it says so (or the setting does, for
    a tool that says nothing), and it is a Python tool of the registry, which a tool process
    imports too (an MCP server's tool or a sub-agent runs in the worker)."""
    where = tool.isolation or get_settings().tool_isolation
    return where == "process" and tool.agent is None and tool.name in get_registry().tools


def _execute_in_process(
    tool: Tool, arguments: dict[str, Any], context: ToolContext, *, limit: float
) -> Outcome:
    try:
        reply = tool_processes.call(tool.name, arguments, context, timeout=limit)
    except tool_processes.NotRun as exc:
        return Outcome(ok=False, error=f"{tool.name} did not run: {exc}")
    except tool_processes.Stopped as exc:
        return Outcome(ok=False, error=f"{tool.name} {exc}", unknown=True, stopped=True)
    return Outcome.from_wire(reply)


def failed(name: str, exc: Exception) -> Outcome:
    """The outcome of a call of tool ``name`` that raised ``exc``."""
    if isinstance(exc, Wait):
        return Outcome(ok=False, parking=Parking.of(exc))
    if isinstance(exc, ToolOutcomeUnknown):  # e.g. an MCP server that died mid-call
        return Outcome(ok=False, error=storable_text(_text_of(exc)), unknown=True)
    if isinstance(exc, RatchetError):
        return Outcome(ok=False, error=storable_text(_text_of(exc)))
    # A tool's bug goes back to the model, it does not crash the task.
    error = f"{name} raised {type(exc).__name__}: {_text_of(exc)}"
    return Outcome(ok=False, error=storable_text(error))


def succeeded(name: str, result: Any) -> Outcome:
    """The outcome of a call of tool ``name`` that returned ``result``: as JSON holds it."""
    try:
        return Outcome(ok=True, result=as_json(result))
    except NotJSON as exc:
        error = f"{name} returned a result that JSON cannot hold: {exc}"
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
