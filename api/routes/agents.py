"""``/v1/agents``: the registered agents, their tools and the tools' JSON schemas."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import Reader
from api.params import cursor_after, encode_cursor
from api.schemas.agents import AgentList, AgentOut, ToolOut
from shared.agents.registry import Agent, Tool, get_registry
from shared.mcp.names import is_mcp_name

router = APIRouter(prefix="/v1/agents", tags=["agents"])


@router.get("", response_model=AgentList, summary="List the agents")
def list_agents(
    _: Reader,
    limit: Annotated[int, Query(ge=1, le=200, description="at most this many")] = 100,
    cursor: Annotated[
        str | None, Query(max_length=200, description="``next_cursor`` of the page before")
    ] = None,
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
