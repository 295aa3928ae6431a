"""Model providers behind one interface: ``complete(ModelRequest) -> ModelResponse``."""

from __future__ import annotations

from functools import cache

from shared.model_strings import parse_model
from shared.settings import get_settings
from workers.providers.base import ModelRequest, ModelResponse, Provider, ToolCallRequest

__all__ = [
    "ModelRequest",
    "ModelResponse",
    "Provider",
    "ToolCallRequest",
    "get_provider",
    "preload",
]


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


def preload() -> list[str]:
    """Import the SDK of every provider this deployment is set up for (its key or its URL
    is set), and return their names. A worker calls it before it forks: the processes share
    the modules, and no step waits for an import. Left to the first call, importing the
    OpenAI SDK takes a second of CPU, and longer in a busy process, while every step of
    that process that wants it waits on the import's lock."""
    settings = get_settings()
    configured = {
        "openai": settings.openai_api_key or settings.openai_base_url,
        "anthropic": settings.anthropic_api_key or settings.anthropic_base_url,
    }
    names = [name for name, setting in configured.items() if setting]
    for name in names:
        _provider(name)
    return names
