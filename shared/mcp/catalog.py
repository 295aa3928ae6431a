"""MCP tools as Ratchet tools: named ``<server>.<tool>`` (``<server>.*`` names them all), their
JSON schemas as the server lists them, and their metadata from the server's annotations and
the operator's overrides. The rest of the engine sees an ordinary :class:`Tool`: the ledger,
approvals and the unknown-outcome policy apply to it unchanged.

Annotations: ``readOnlyHint`` or ``idempotentHint`` make a tool idempotent (re-run after a
crash, with the same idempotency key); ``destructiveHint`` (set true) makes each call wait for
a person's approval; a tool the server says nothing about is neither. An override in the
server's ``tools`` wins over both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import mcp_types as types
from pydantic import BaseModel

from shared.agents.registry import Tool, ToolContext
from shared.errors import ToolArgumentsInvalid, ToolError
from shared.mcp import connections
from shared.mcp.config import ServerConfig, current
from shared.mcp.names import WILDCARD, split
from shared.mcp.results import tool_result

# The API waits at most this long for a server's list (a submission then takes the tool's name
# on trust): a server that is slow to start must not hold the API's answer.
API_LIST_SECONDS = 5.0
# Past its own timeout a call is given up by the MCP session; the tool runner's limit, a little
# later, is only a backstop.
_RUNNER_MARGIN_SECONDS = 5.0


class _NoArguments(BaseModel):
    """Stands in for an MCP tool's arguments model: the server's JSON schema is the schema."""


def _not_called(**_: Any) -> Any:  # an McpTool's invoke calls its server
    raise NotImplementedError


@dataclass(frozen=True, eq=False)  # compared and hashed as a Tool (its schema is a dict)
class McpTool(Tool):
    """A tool of an MCP server: each call goes to the server's session in this process."""

    server: str = ""
    remote_name: str = ""
    schema: dict[str, Any] = field(default_factory=dict)
    config: ServerConfig | None = None
    # The server could not list its tools: every call is a tool error, nothing is sent.
    unavailable: str | None = None

    @cached_property
    def parameters_schema(self) -> dict[str, Any]:
        return self.schema

    def validate_arguments(self, arguments: Any) -> dict[str, Any]:
        """A JSON object; the server checks it against its schema (a bad call comes back as
        the server's error, which the model reads)."""
        if not isinstance(arguments, dict):
            raise ToolArgumentsInvalid(f"arguments of {self.name} must be a JSON object")
        return arguments

    def invoke(self, arguments: dict[str, Any], context: ToolContext) -> Any:
        if self.unavailable is not None or self.config is None:
            raise ToolError(self.unavailable or f"MCP server {self.server!r} is not declared")
        result = connections.call_tool(
            self.server,
            self.remote_name,
            self.validate_arguments(arguments),
            config=self.config,
            idempotency_key=context.idempotency_key,
        )
        return tool_result(result)


def problem(name: str, *, agent: str, check_tool: bool = True) -> str | None:
    """Why a task of ``agent`` may not name the MCP tool ``name``, or None if it may.

    A server must be declared and allow the agent. A named tool must be on the server's list,
    unless the server cannot be listed now: then the name is taken on trust (the server may
    be down for a moment), and a call to a tool it does not have is a tool error later.
    """
    found = split(name)
    assert found is not None
    server, tool = found
    config = current().get(server)
    if config is None:
        declared = ", ".join(sorted(current())) or "none"
        return f"unknown MCP server {server!r} in {name!r} (declared: {declared})"
    if not config.allows(agent):
        return f"MCP server {server!r} is not available to agent {agent!r}"
    if tool == WILDCARD or not check_tool:
        return None
    try:
        listed = _listed(server, config, timeout=API_LIST_SECONDS)
    except ToolError:
        return None
    if tool not in {t.remote_name for t in listed}:
        return f"MCP server {server!r} has no tool {tool!r}"
    return None


def resolve(names: Iterable[str], *, agent: str, timeout: float | None = None) -> dict[str, Tool]:
    """The MCP tools among ``names`` by name, for a task of ``agent``: ``<server>.*`` expands
    to every tool the server lists. A server that cannot be listed contributes the tools
    named explicitly, as tools whose every call is a tool error (the model reads it, the task
    goes on); an undeclared server, or one not available to the agent, contributes none.
    ``timeout``: the longest wait for a list (by default each server's timeout)."""
    tools: dict[str, Tool] = {}
    servers = current()
    for name in names:
        found = split(name)
        if found is None:
            continue
        server, tool = found
        config = servers.get(server)
        if config is None or not config.allows(agent):
            continue
        try:
            listed = _listed(server, config, timeout=timeout)
        except ToolError as exc:
            if tool != WILDCARD:
                tools[name] = _unavailable(name, server, tool, str(exc))
            continue
        for each in listed:
            if tool in (WILDCARD, each.remote_name):
                tools[each.name] = each
        if tool != WILDCARD and name not in tools:
            tools[name] = _unavailable(name, server, tool, f"{server!r} has no tool {tool!r}")
    return tools


def may_wait(names: Iterable[str], *, agent: str) -> bool:
    """Whether :func:`resolve` may have to ask a server (to list its tools) rather than answer
    from this process's lists at once."""
    from shared.settings import get_settings

    ttl, servers = get_settings().mcp_tools_ttl_seconds, current()
    for name in names:
        found = split(name)
        config = servers.get(found[0]) if found is not None else None
        if found is None or config is None or not config.allows(agent):
            continue
        if not connections.listed_within(found[0], config=config, max_age=ttl):
            return True
    return False


def listed_tools(server: str) -> list[McpTool]:
    """The tools ``server`` lists now, as Ratchet tools (ToolError if it cannot be listed)."""
    config = current().get(server)
    if config is None:
        raise ToolError(f"unknown MCP server {server!r}")
    return list(_listed(server, config))


def _listed(
    server: str, config: ServerConfig, *, timeout: float | None = None
) -> tuple[McpTool, ...]:
    from shared.settings import get_settings

    ttl = get_settings().mcp_tools_ttl_seconds
    listing = connections.list_tools(server, config=config, max_age=ttl, timeout=timeout)
    return _as_tools(server, config, listing)


_converted: dict[tuple[str, ServerConfig], tuple[tuple[types.Tool, ...], tuple[McpTool, ...]]] = {}


def _as_tools(
    server: str, config: ServerConfig, listing: tuple[types.Tool, ...]
) -> tuple[McpTool, ...]:
    """A listing's tools as Ratchet tools, made once per listing (steps ask on each lease)."""
    key = (server, config)
    kept = _converted.get(key)
    if kept is not None and kept[0] is listing:
        return kept[1]
    made = tuple(as_tool(server, config, each) for each in listing)
    _converted[key] = (listing, made)
    return made


def as_tool(server: str, config: ServerConfig, listed: types.Tool) -> McpTool:
    """One listed tool as a Ratchet tool: annotations mapped, the operator's overrides over them."""
    hints = listed.annotations
    idempotent = bool(hints and (hints.read_only_hint or hints.idempotent_hint))
    approval = bool(hints and hints.destructive_hint)
    override = config.tools.get(listed.name)
    policy = config.on_unknown_outcome
    if override is not None:
        idempotent = idempotent if override.idempotent is None else override.idempotent
        approval = approval if override.requires_approval is None else override.requires_approval
        policy = override.on_unknown_outcome or policy
    schema = dict(listed.input_schema or {"type": "object"})
    schema.pop("title", None)
    return McpTool(
        name=f"{server}.{listed.name}",
        description=listed.description or listed.title or listed.name,
        func=_not_called,
        arguments_model=_NoArguments,
        idempotent=idempotent,
        requires_approval=approval,
        timeout=config.timeout_seconds + _RUNNER_MARGIN_SECONDS,
        on_unknown_outcome=policy,
        wants_context=True,
        server=server,
        remote_name=listed.name,
        schema=schema,
        config=config,
    )


def _unavailable(name: str, server: str, tool: str, why: str) -> McpTool:
    return McpTool(
        name=name,
        description=f"a tool of the MCP server {server!r}, which is unavailable now",
        func=_not_called,
        arguments_model=_NoArguments,
        server=server,
        remote_name=tool,
        schema={"type": "object"},
        unavailable=f"MCP server {server!r}: {why}",
    )
