"""``/v1/agents``: the agents and their tools."""

from __future__ import annotations

from datetime import datetime
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


class AgentVersionOut(BaseModel):
    id: str = Field(description="the SHA-256 of the definition's canonical JSON")
    agent: str
    created_at: datetime = Field(description="when a task first ran it")


class AgentVersionDetail(AgentVersionOut):
    definition: dict[str, Any] = Field(
        description="the agent as its tasks run it: `system_prompt`, `model`, `max_steps`, "
        "`context`, `output_schema`, and `tools`, each with its `description`, `parameters` "
        "(JSON Schema) and behaviour (`idempotent`, `requires_approval` — true, false or "
        '`"predicate"` —, `timeout`, …); an MCP tool is its name alone'
    )


class AgentVersionList(BaseModel):
    items: list[AgentVersionOut]
    next_cursor: str | None
