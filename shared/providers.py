"""Model strings (``provider:model``) and what the scripted model's options look like."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.errors import InvalidRequest

PROVIDERS = ("openai", "anthropic", "scripted")


def parse_model(model: str) -> tuple[str, str]:
    """Split ``provider:model``; ``scripted`` needs no model name."""
    provider, _, name = model.partition(":")
    if provider not in PROVIDERS:
        raise InvalidRequest(
            "model", f"unknown model provider {provider!r}; known: {', '.join(PROVIDERS)}"
        )
    if provider != "scripted" and not name:
        raise InvalidRequest("model", f"write the model as '{provider}:<model name>'")
    return provider, name


class ScriptedToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ScriptedUsage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_tokens: int = Field(0, ge=0)
    output_tokens: int = Field(0, ge=0)


class ScriptTurn(BaseModel):
    """One model call's answer. ``error`` fails the call ``times`` times, then it answers."""

    model_config = ConfigDict(extra="forbid")

    content: str | None = None
    tool_calls: list[ScriptedToolCall] = Field(default_factory=list)
    delay_ms: int = Field(0, ge=0, le=600_000)
    error: Literal["rate_limit", "server_error", "timeout"] | None = None
    times: int = Field(1, ge=1)
    usage: ScriptedUsage | None = None


class Script(BaseModel):
    model_config = ConfigDict(extra="allow")

    script: list[ScriptTurn] = Field(default_factory=list)
