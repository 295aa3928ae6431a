"""Model strings (``provider:model``) and what the scripted model's options look like."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.errors import InvalidRequest

if TYPE_CHECKING:
    from shared.settings import Settings

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


def check_available(provider: str, settings: Settings) -> None:
    """Refuse a model no worker could call: the scripted model while it is off, or a provider
    with neither an API key nor a base URL of its own (a local OpenAI- or Anthropic-compatible
    server may need no key)."""
    if provider == "scripted":
        if not settings.scripted_model:
            raise InvalidRequest(
                "model", "the scripted model is off on this server (RATCHET_SCRIPTED_MODEL)"
            )
        return
    key = getattr(settings, f"{provider}_api_key")
    base_url = getattr(settings, f"{provider}_base_url")
    if key is None and base_url is None:
        setting = f"RATCHET_{provider.upper()}_API_KEY"
        raise InvalidRequest("model", f"{provider} models are not configured ({setting} is unset)")


def script_delays_over(script: Script, max_delay_ms: int) -> str | None:
    """The field of the first turn that would sleep longer than ``max_delay_ms``, if any."""
    for index, turn in enumerate(script.script):
        if turn.delay_ms > max_delay_ms:
            return f"model_options.script[{index}].delay_ms"
    return None


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
