"""``/v1/agents``: the registered agents, their tools and the tools' JSON schemas, and the
versions of each agent that tasks ran (``shared.agents.versions``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path

from api.deps import Reader, SessionDep
from api.params import PageCursor, PageLimit, cursor_after, encode_cursor
from api.problems import responses
from api.schemas.agents import (
    AgentList,
    AgentOut,
    AgentVersionDetail,
    AgentVersionList,
    AgentVersionOut,
    ToolOut,
)
from shared.agents.registry import Agent, Tool, get_registry
from shared.errors import InvalidRequest, NotFound
from shared.mcp.names import is_mcp_name
from shared.store import agent_versions
from shared.store.tables import AgentVersion
from shared.views import aware

router = APIRouter(prefix="/v1/agents", tags=["agents"])


@router.get("", response_model=AgentList, summary="List the agents")
def list_agents(
    _: Reader,
    limit: PageLimit = 100,
    cursor: PageCursor = None,
) -> AgentList:
    """The registered agents by name, each with its tools and their argument schemas."""
    registry = get_registry()
    after = cursor_after(cursor) or ""
    names = sorted(n for n in registry.agents if n > after)
    page, more = names[:limit], len(names) > limit
    items = []
    for name in page:
        agent = registry.agents[name]
        tools = _tools_of(agent)
        items.append(
            AgentOut(
                name=agent.name,
                description=agent.description,
                model=agent.model,
                max_steps=agent.max_steps,
                output_schema=agent.output_schema,
                tools=[
                    ToolOut(
                        name=t.name,
                        description=t.description,
                        parameters=t.parameters_schema,
                        idempotent=t.idempotent,
                        requires_approval=t.requires_approval is not False,
                        timeout=t.timeout,
                        server=getattr(t, "server", None),  # an MCP tool's server
                    )
                    for t in tools
                ],
            )
        )
    return AgentList(items=items, next_cursor=encode_cursor(page[-1]) if more else None)


def _tools_of(agent: Agent) -> list[Tool]:
    """The agent's tools, its MCP servers' as they list them now (``server.*`` expanded; a
    server slow to list is waited for only a few seconds)."""
    registry = get_registry()
    mcp = [name for name in agent.tools if is_mcp_name(name)]
    found = {}
    if mcp:
        from shared.mcp import catalog  # the MCP SDK loads only where an agent names a server

        found = catalog.resolve(mcp, agent=agent.name, timeout=catalog.API_LIST_SECONDS)
    return [registry.tools[n] for n in agent.tools if n in registry.tools] + list(found.values())


AgentName = Annotated[str, Path(max_length=100, description="the agent's name")]
VERSION_RESPONSES = responses({404: "no such agent (registered, or named by a version)"})


@router.get(
    "/{name}/versions",
    response_model=AgentVersionList,
    summary="List the versions of an agent that tasks ran",
    responses=VERSION_RESPONSES,
)
def list_agent_versions(
    name: AgentName,
    _: Reader,
    session: SessionDep,
    limit: PageLimit = 50,
    cursor: PageCursor = None,
) -> AgentVersionList:
    """The agent's versions, newest first: each definition a task was submitted with, by its
    id, and when a task first ran it. Agents are the fleet's, not a tenant's (as in
    ``GET /v1/agents``): every version is listed, whichever tenant's task ran it."""
    after = _position(cursor_after(cursor))
    with session.begin():
        rows, last = agent_versions.list_versions(session, name, limit=limit, after=after)
        if not rows and after is None and not _known(session, name):
            raise NotFound(f"no agent named {name!r}")
    items = [_version_out(row) for row in rows]
    return AgentVersionList(items=items, next_cursor=_cursor(last) if last else None)


@router.get(
    "/{name}/versions/{version_id}",
    response_model=AgentVersionDetail,
    summary="Get one version of an agent",
    responses=responses({404: "the agent has no such version"}),
)
def get_agent_version(
    name: AgentName,
    version_id: Annotated[str, Path(max_length=64, description="the version's id")],
    _: Reader,
    session: SessionDep,
) -> AgentVersionDetail:
    """The version's whole definition: what a task pinned to it runs."""
    with session.begin():
        row = agent_versions.get_version(session, name, version_id)
    return AgentVersionDetail(**_version_out(row).model_dump(), definition=row.definition)


def _known(session: SessionDep, name: str) -> bool:
    """Registered here, or run once (a deploy may have removed it since)."""
    return name in get_registry().agents or agent_versions.has_versions(session, name)


def _version_out(row: AgentVersion) -> AgentVersionOut:
    created_at = aware(row.created_at)
    assert created_at is not None
    return AgentVersionOut(id=row.id, agent=row.agent, created_at=created_at)


def _cursor(last: agent_versions.Position) -> str:
    created_at = aware(last[0])
    assert created_at is not None
    return encode_cursor(f"{created_at.isoformat()} {last[1]}")


def _position(after: str | None) -> agent_versions.Position | None:
    """A ``next_cursor``'s place: the last listed version's creation time and id."""
    if after is None:
        return None
    at, _, version_id = after.partition(" ")
    try:
        created_at = datetime.fromisoformat(at)
    except ValueError:
        created_at = None
    if created_at is None or created_at.tzinfo is None or not version_id:
        raise InvalidRequest("cursor", "not a cursor this API returned")
    return created_at, version_id
