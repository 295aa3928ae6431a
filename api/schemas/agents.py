"""``/v1/agents``: the agents and their tools."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ToolOut(BaseModel):
    name: str
    description: str
    parameters: dict[str, Any]
    idempotent: bool
    requires_approval: bool = Field(
        description="whether its calls wait for a person: always, or as a predicate over the "
        "arguments decides (a submission may ask for more)"
    )
    timeout: float | None
    server: str | None = Field(
        None,
        description="the MCP server whose tool it is (named `<server>.<tool>`); null for a "
        "Python tool",
    )


class AgentOut(BaseModel):
    name: str
    description: str
    model: str | None
    max_steps: int | None
    tools: list[ToolOut]
    output_schema: dict[str, Any] | None = Field(
        None, description="the JSON Schema its final answers must meet, unless a task gives one"
    )


class AgentList(BaseModel):
    items: list[AgentOut]
    next_cursor: str | None
