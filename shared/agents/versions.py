"""Pinned agent versions: a task runs the agent definition it was submitted with.

A version is an agent's definition as the model and the step see it: its system prompt,
model, step limit, context policy and output schema, and each tool's description, argument
schema and behaviour (idempotent, approval, time limits, …). Its id is the SHA-256 of the
definition's canonical JSON, so one definition is one row (``agent_versions``) however many
tasks name it, written once (insert-if-absent) the first time a process submits it.

A step of a pinned task takes the system prompt and the tools' descriptions, schemas and
behaviour from its version, never from the live registry: a deploy that changes an agent
leaves its running tasks as they were. A tool's *code* cannot be pinned: it runs as the
worker's deployment has it, and a tool that deployment no longer has answers each call with
a clear error the model reads (:func:`unavailable_tool`), recorded in the ledger like any
tool error. MCP tools are pinned by name (``server.tool``, ``server.*``): their servers list
them when the step runs.

Each process keeps what it has computed, written and read: computing a definition hashes
JSON schemas, so it is done once per agent and set of tools (:func:`version_of`); a version
written is not written again (:func:`record`); a version read is never read again (rows
never change). In the steady state a submission and a step cost no round trip for it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any
from weakref import WeakKeyDictionary

from pydantic import BaseModel, ConfigDict
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, SessionTransaction

from shared.agents.registry import Agent, Tool, get_agent, get_registry
from shared.errors import NotFound, ToolError
from shared.mcp.names import is_mcp_name
from shared.store import agent_versions

# What a version holds of an agent and of each of its Python tools. The other fields are
# left out on purpose: an agent's ``description`` is shown in ``/v1/agents`` but never sent to
# the model; a tool's ``func``, ``arguments_model`` and ``wants_context`` are its code.
AGENT_FIELDS = (
    "system_prompt",
    "model",
    "max_steps",
    "context",
    "output_schema",
    "stream",
    "model_options",
)
# Fields a definition holds only when set: a field added later leaves the ids of the agents
# that do not use it as they were.
OPTIONAL_AGENT_FIELDS = ("model_options",)
TOOL_FIELDS = (
    "description",
    "idempotent",
    "requires_approval",
    "timeout",
    "on_unknown_outcome",
    "approval_timeout",
    "on_approval_timeout",
    "max_result_chars",
    "isolation",
    "secrets",
)
# Tool fields a definition holds only when set (see OPTIONAL_AGENT_FIELDS).
OPTIONAL_TOOL_FIELDS = ("isolation", "secrets")
AGENT_NOT_PINNED = ("description",)
TOOL_CODE = ("func", "arguments_model", "wants_context", "agent")
# ``requires_approval`` as a version stores a predicate over the arguments: the predicate
# itself is code, and runs as the worker's deployment has it.
PREDICATE = "predicate"


@dataclass(frozen=True)
class Version:
    """One agent version: its id (the hash of ``definition``), its agent and definition."""

    id: str
    agent: str
    definition: dict[str, Any]

    @cached_property
    def pinned_agent(self) -> Agent:
        """The agent as this version defines it (what a step reads of it: the system prompt)."""
        spec = self.definition
        return Agent(
            name=self.agent,
            tools=tuple(t["name"] for t in spec["tools"]),
            # A field a later release added is absent from an older row: the default's.
            **{name: spec[name] for name in AGENT_FIELDS if name in spec},
        )

    @cached_property
    def pinned_tools(self) -> dict[str, dict[str, Any]]:
        """The version's Python tools' definitions by name (MCP tools are names only)."""
        return {t["name"]: t for t in self.definition["tools"] if "parameters" in t}


def definition_of(agent: Agent, tools: Mapping[str, Tool]) -> dict[str, Any]:
    """``agent``'s definition, its tools looked up in ``tools`` (a name not there is an MCP
    tool's, kept as a name)."""
    listed = [tool_definition(tools[n]) if n in tools else {"name": n} for n in agent.tools]
    fields = {
        f: getattr(agent, f)
        for f in AGENT_FIELDS
        if f not in OPTIONAL_AGENT_FIELDS or getattr(agent, f) is not None
    }
    return {"name": agent.name, **fields, "tools": listed}


def tool_definition(tool: Tool) -> dict[str, Any]:
    rule = tool.requires_approval
    behaviour = {
        f: getattr(tool, f)
        for f in TOOL_FIELDS
        if f not in OPTIONAL_TOOL_FIELDS or getattr(tool, f)
    }
    if "secrets" in behaviour:
        behaviour["secrets"] = list(tool.secrets)
    behaviour["requires_approval"] = PREDICATE if callable(rule) else bool(rule)
    return {"name": tool.name, "parameters": tool.parameters_schema, **behaviour}


def version_id(definition: dict[str, Any]) -> str:
    """The SHA-256 of the definition's canonical JSON (sorted keys, no spaces)."""
    canonical = json.dumps(definition, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


# --- the live registry's versions --------------------------------------------------------------

# By agent name: the agent and tool objects a version was computed from, and the version. The
# registry is read-only once loaded, but an agent registered again (a reloaded module, a test)
# is another object, and so is a tool: either makes the version computed anew.
_computed: dict[str, tuple[Agent, tuple[Tool | None, ...], Version]] = {}


def version_of(agent: Agent) -> Version:
    """``agent``'s current version, as the live registry defines it (computed once per agent
    and set of tool objects)."""
    tools = get_registry().tools
    now = tuple(tools.get(n) for n in agent.tools)
    known = _computed.get(agent.name)
    if known is not None and known[0] is agent and _same_objects(known[1], now):
        return known[2]
    definition = definition_of(agent, tools)
    version = Version(version_id(definition), agent.name, definition)
    _computed[agent.name] = (agent, now, version)
    _read[version.id] = version
    return version


def _same_objects(before: tuple[Tool | None, ...], now: tuple[Tool | None, ...]) -> bool:
    return len(before) == len(now) and all(a is b for a, b in zip(before, now, strict=True))


# --- writing versions --------------------------------------------------------------------------

# By database (an engine: a process, a test run, may move from one database to another; an
# engine dropped takes its entry along): the versions this process knows are committed there.
_written: WeakKeyDictionary[Engine, set[str]] = WeakKeyDictionary()
_PENDING = "ratchet.agent_versions.pending"
_lock = threading.Lock()


def current_version(session: Session, agent: str) -> str:
    """The id of ``agent``'s current version (the live registry's), its row written in
    ``session``'s transaction unless this process knows it is there. What a new task (a
    schedule's tick, a thread's turn) runs. NotFound for an unknown agent."""
    version = version_of(get_agent(agent))
    record(session, version.id)
    return version.id


def record(session: Session, version_id: str) -> None:
    """Write the row of version ``version_id`` (one this process computed: ``version_of``)
    unless it is there (insert-if-absent), in ``session``'s transaction. The process
    remembers it as written only once that transaction commits, so a rolled-back one never
    leaves a task naming a version no row holds. In the steady state: two lookups."""
    engine = session.get_bind().engine
    written = _written.get(engine)
    if written is not None and version_id in written:
        return
    version = _read[version_id]
    agent_versions.insert_if_absent(
        session, version_id=version.id, agent=version.agent, definition=version.definition
    )
    pending = session.info.get(_PENDING)
    if pending is None:
        pending = session.info[_PENDING] = set()
        event.listen(session, "after_commit", _committed)
        event.listen(session, "after_transaction_end", _ended)
    pending.add((engine, version_id))


def _committed(session: Session) -> None:
    if session.in_nested_transaction():  # a savepoint's: the transaction may still roll back
        return
    with _lock:
        for engine, version_id in session.info.get(_PENDING, ()):
            _written.setdefault(engine, set()).add(version_id)


def _ended(session: Session, transaction: SessionTransaction) -> None:
    """After the commit (``_committed`` has run) or the rollback of the session's outermost
    transaction: nothing is pending any more."""
    if transaction.parent is None:
        session.info.get(_PENDING, set()).clear()


# --- reading versions --------------------------------------------------------------------------

# By id: every version this process computed or read. Rows never change, so never stale.
_read: dict[str, Version] = {}


def cached_version(version_id: str) -> Version | None:
    """Version ``version_id`` if this process has computed or read it."""
    return _read.get(version_id)


def load_version(version_id: str, session: Session) -> Version:
    """Version ``version_id``, read from ``session`` the first time this process needs it
    (NotFound if no row holds it)."""
    found = _read.get(version_id)
    if found is not None:
        return found
    row = agent_versions.find_version(session, version_id)
    if row is None:
        raise NotFound(f"no agent version {version_id}")
    found = _read[version_id] = Version(row.id, row.agent, row.definition)
    return found


def pinned_tools(version: Version, names: Iterable[str]) -> dict[str, Tool]:
    """The Python tools among ``names`` (a task's tools) as ``version`` defines them: the
    worker's code with the version's description, schema and behaviour, or, for a tool this
    deployment no longer has, one that refuses every call (:func:`unavailable_tool`). MCP
    names are left to the MCP catalog; a name the version does not list (a task from before
    pinning never gets here) is the live registry's."""
    live = get_registry().tools
    tools: dict[str, Tool] = {}
    for name in names:
        spec = version.pinned_tools.get(name)
        if spec is not None:
            code = live.get(name)
            tools[name] = unavailable_tool(spec) if code is None else pinned_tool(code, spec)
        elif not is_mcp_name(name) and name in live:
            tools[name] = live[name]
    return tools


@dataclass(frozen=True)
class PinnedTool(Tool):
    """A tool as a pinned version describes it: the description, argument schema and
    behaviour the version holds, around the code of this deployment."""

    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters


def pinned_tool(code: Tool, spec: dict[str, Any]) -> PinnedTool:
    """``code`` (the live tool) described and behaving as ``spec`` says. A predicate that
    decides approval is code: the live one, or, if the tool no longer has one, always ask."""
    behaviour = _behaviour(spec)
    if behaviour.get("requires_approval") == PREDICATE:
        live_rule = code.requires_approval
        behaviour["requires_approval"] = live_rule if callable(live_rule) else True
    own = {f.name: getattr(code, f.name) for f in dataclasses.fields(Tool)}
    return PinnedTool(**(own | behaviour), parameters=spec["parameters"])


def _behaviour(spec: dict[str, Any]) -> dict[str, Any]:
    """A pinned tool's behaviour; a field a later release added is absent from an older row's
    tools (then the deployed tool's, or the default, holds)."""
    behaviour = {f: spec[f] for f in TOOL_FIELDS if f in spec}
    if "secrets" in behaviour:
        behaviour["secrets"] = tuple(behaviour["secrets"])
    return behaviour


class _AnyArguments(BaseModel):
    model_config = ConfigDict(extra="allow")


def unavailable_tool(spec: dict[str, Any]) -> PinnedTool:
    """A tool the pinned version lists and this deployment does not have: the model still
    sees it as the task began with it, and each call is a tool error that says why. Nothing
    runs, so there is nothing to approve and a call may be tried again after a crash."""
    name = spec["name"]

    def refuse() -> None:
        raise ToolError(
            f"tool {name!r} is not available in this deployment (removed after the task "
            "started); the call was not run"
        )

    behaviour = _behaviour(spec) | {
        "idempotent": True,
        "requires_approval": False,
    }
    return PinnedTool(
        name=name,
        func=refuse,
        arguments_model=_AnyArguments,
        parameters=spec["parameters"],
        **behaviour,
    )
