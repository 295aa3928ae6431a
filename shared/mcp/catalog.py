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
from dataclasses import dataclass, field, replace
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
    # This process's session with the server (connections.py) is keyed by it: the server's
    # name, or for a tenant's own server its name and tenant (two tenants may pick one name).
    link: str = ""
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
            self.link or self.server,
            self.remote_name,
            self.validate_arguments(arguments),
            config=self.config,
            idempotency_key=context.idempotency_key,
        )
        return tool_result(result)


def problem(
    name: str, *, agent: str, tenant_id: str | None = None, check_tool: bool = True
) -> str | None:
    """Why a task of ``agent`` (and of ``tenant_id``) may not name the MCP tool ``name``, or
    None if it may.

    A server must be declared by the operator and allow the agent, or be one the tenant
    registered. A named tool must be on the server's list, unless the server cannot be
    listed now: then the name is taken on trust (the server may be down for a moment, a
    secret its headers name may be set later), and a call to a tool it does not have is a
    tool error later.
    """
    found = split(name)
    assert found is not None
    server, tool = found
    servers = _servers([name], tenant_id)
    if server not in servers:
        declared = ", ".join(sorted(servers)) or "none"
        return f"unknown MCP server {server!r} in {name!r} (declared: {declared})"
    known = servers[server]
    if isinstance(known.config, ServerConfig) and not known.config.allows(agent):
        return f"MCP server {server!r} is not available to agent {agent!r}"
    if tool == WILDCARD or not check_tool or not isinstance(known.config, ServerConfig):
        return None
    try:
        listed = _listed(server, known, timeout=API_LIST_SECONDS)
    except ToolError:
        return None
    if tool not in {t.remote_name for t in listed}:
        return f"MCP server {server!r} has no tool {tool!r}"
    return None


def resolve(
    names: Iterable[str],
    *,
    agent: str,
    tenant_id: str | None = None,
    timeout: float | None = None,
) -> dict[str, Tool]:
    """The MCP tools among ``names`` by name, for a task of ``agent`` (and of ``tenant_id``,
    whose own servers count too): ``<server>.*`` expands to every tool the server lists. A
    server that cannot be listed (or whose headers name a secret that cannot be read)
    contributes the tools named explicitly, as tools whose every call is a tool error (the
    model reads it, the task goes on); an undeclared server, or one not available to the
    agent, contributes none. ``timeout``: the longest wait for a list (by default each
    server's timeout)."""
    names = list(names)
    tools: dict[str, Tool] = {}
    servers = _servers(names, tenant_id)
    for name in names:
        found = split(name)
        if found is None:
            continue
        server, tool = found
        known = servers.get(server)
        if known is None:
            continue
        if isinstance(known.config, ServerConfig) and not known.config.allows(agent):
            continue
        try:
            listed = _listed(server, known, timeout=timeout)
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


def may_wait(names: Iterable[str], *, agent: str, tenant_id: str | None = None) -> bool:
    """Whether :func:`resolve` may have to ask a server (to list its tools) rather than answer
    from this process's lists at once."""
    from shared.settings import get_settings

    names = list(names)
    ttl, servers = get_settings().mcp_tools_ttl_seconds, _servers(names, tenant_id)
    for name in names:
        found = split(name)
        known = servers.get(found[0]) if found is not None else None
        if known is None or not isinstance(known.config, ServerConfig):
            continue
        if not known.config.allows(agent):
            continue
        if not connections.listed_within(known.link, config=known.config, max_age=ttl):
            return True
    return False


def listed_tools(server: str) -> list[McpTool]:
    """The tools the operator's ``server`` lists now, as Ratchet tools (ToolError if it
    cannot be listed)."""
    config = current().get(server)
    if config is None:
        raise ToolError(f"unknown MCP server {server!r}")
    return list(_listed(server, Server(config, link=server)))


@dataclass(frozen=True)
class Server:
    """A server a task may name: its configuration (or why it cannot be used now: a tenant's
    server whose headers name a secret that cannot be read), the key of this process's
    session with it, and the tenant secrets its headers name (its tools' results and this
    process's logs are redacted of them, as a Python tool's that declares them)."""

    config: ServerConfig | str
    link: str
    secrets: tuple[str, ...] = ()


def _servers(names: Iterable[str], tenant_id: str | None) -> dict[str, Server]:
    """The operator's servers, and (only when ``names`` name a server the operator has not
    declared, and a tenant is given) those of the tenant's own servers: one query, then."""
    operator = current()
    servers = {name: Server(config, link=name) for name, config in operator.items()}
    wanted = {found[0] for name in names if (found := split(name)) is not None} - set(operator)
    if tenant_id is None or not wanted:
        return servers
    from shared.mcp import tenant_servers  # reads the database

    for name, (config, secrets) in tenant_servers.configs(tenant_id, wanted).items():
        servers[name] = Server(config, link=f"{name}@{tenant_id}", secrets=secrets)
    return servers


def _listed(server: str, known: Server, *, timeout: float | None = None) -> tuple[McpTool, ...]:
    from shared.settings import get_settings

    if not isinstance(known.config, ServerConfig):
        raise ToolError(known.config)
    ttl = get_settings().mcp_tools_ttl_seconds
    listing = connections.list_tools(known.link, config=known.config, max_age=ttl, timeout=timeout)
    return _as_tools(server, known, listing)


_converted: dict[tuple[str, Server], tuple[tuple[types.Tool, ...], tuple[McpTool, ...]]] = {}


def _as_tools(server: str, known: Server, listing: tuple[types.Tool, ...]) -> tuple[McpTool, ...]:
    """A listing's tools as Ratchet tools, made once per listing (steps ask on each lease)."""
    key = (server, known)
    kept = _converted.get(key)
    if kept is not None and kept[0] is listing:
        return kept[1]
    assert isinstance(known.config, ServerConfig)
    made = tuple(
        replace(as_tool(server, known.config, each), link=known.link, secrets=known.secrets)
        for each in listing
    )
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
