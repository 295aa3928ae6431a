"""Provider SDKs: a worker imports the ones it is set up for before it forks, and the SDK
clients of a process share one TLS context (building one loads the CA bundle)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from shared.settings import get_settings
from workers import providers
from workers.providers import base
from workers.providers.anthropic import AnthropicProvider
from workers.providers.openai import OpenAIProvider


@pytest.fixture
def provider_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in (
        "RATCHET_OPENAI_API_KEY",
        "RATCHET_OPENAI_BASE_URL",
        "RATCHET_ANTHROPIC_API_KEY",
        "RATCHET_ANTHROPIC_BASE_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    yield monkeypatch
    get_settings.cache_clear()


def test_preload_loads_the_providers_set_up_and_no_other(provider_env: pytest.MonkeyPatch) -> None:
    assert providers.preload() == []
    provider_env.setenv("RATCHET_OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    get_settings.cache_clear()
    assert providers.preload() == ["openai"]
    provider_env.setenv("RATCHET_ANTHROPIC_API_KEY", "sk-ant-test")
    get_settings.cache_clear()
    assert providers.preload() == ["openai", "anthropic"]
    assert isinstance(providers.get_provider("openai:gpt-4o")[0], OpenAIProvider)


def test_every_sdk_client_of_a_process_shares_its_tls_context(
    provider_env: pytest.MonkeyPatch,
) -> None:
    context = base.tls_context()
    assert base.tls_context() is context
    for provider in (OpenAIProvider(), AnthropicProvider()):
        made = [provider._new_client() for _ in range(3)]
        for client in made:
            pool = client._client._transport._pool  # type: ignore[attr-defined]
            assert pool._ssl_context is context
    assert base._tls == {os.getpid(): context}
