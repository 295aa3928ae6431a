"""``/v1/agents``: the registered agents, their tools and the tools' JSON schemas."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import Reader
from api.params import cursor_after, encode_cursor
from api.schemas.agents import AgentList, AgentOut, ToolOut
from shared.agents.registry import get_registry

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
        tools = [registry.tools[t] for t in agent.tools]
        items.append(
            AgentOut(
                name=agent.name,
                description=agent.description,
                model=agent.model,
                max_steps=agent.max_steps,
                tools=[
                    ToolOut(
                        name=t.name,
                        description=t.description,
                        parameters=t.parameters_schema,
                        idempotent=t.idempotent,
                        requires_approval=t.requires_approval is not False,
                        timeout=t.timeout,
                    )
                    for t in tools
                ],
            )
        )
    return AgentList(items=items, next_cursor=encode_cursor(page[-1]) if more else None)
