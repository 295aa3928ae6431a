"""``/v1/mcp-servers``: a tenant's own MCP servers as registered and listed (header names,
never their values)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from shared.mcp.config import DEFAULT_TIMEOUT_SECONDS


class McpServerCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        min_length=1,
        max_length=64,
        description="its tools are named ``<name>.<tool>`` in a task's ``tools``",
    )
    url: str = Field(
        min_length=1, max_length=2048, description="the server's Streamable HTTP endpoint"
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="sent with every request; a value may name the tenant's secrets "
        '(``"Bearer ${secret:TOKEN}"``); kept encrypted, never shown',
    )
    timeout_seconds: float = Field(
        DEFAULT_TIMEOUT_SECONDS, gt=0, le=300, description="each call, and connecting"
    )


class McpServerOut(BaseModel):
    id: str
    name: str
    url: str
    header_names: list[str]
    timeout_seconds: float
    created_at: datetime


class McpServerList(BaseModel):
    items: list[McpServerOut]
    next_cursor: str | None
