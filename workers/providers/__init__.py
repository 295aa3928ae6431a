"""Model providers behind one interface: ``complete(ModelRequest) -> ModelResponse``."""

from __future__ import annotations

from functools import cache

from shared.providers import parse_model
from workers.providers.base import ModelRequest, ModelResponse, Provider, ToolCallRequest

__all__ = ["ModelRequest", "ModelResponse", "Provider", "ToolCallRequest", "get_provider"]


@cache
def _provider(name: str) -> Provider:
    if name == "scripted":
        from workers.providers.scripted import ScriptedProvider

        return ScriptedProvider()
    if name == "openai":
        from workers.providers.openai import OpenAIProvider

        return OpenAIProvider()
    from workers.providers.anthropic import AnthropicProvider

    return AnthropicProvider()


def get_provider(model: str) -> tuple[Provider, str]:
    """The provider for a ``provider:model`` string, and the model name to send it."""
    provider, name = parse_model(model)
    return _provider(provider), name
