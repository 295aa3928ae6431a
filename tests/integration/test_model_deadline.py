"""A model call against a provider that begins an answer and never ends it (a byte now and
then, so the SDK's per-read timeout never fires): each attempt ends at its deadline, as a
transient failure that the retry policy retries like a provider timeout."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from shared.errors import ModelTransientError
from shared.ratelimit.in_process import LocalLimiter
from tests.conftest import Configure
from tests.fakes.openai_server import OpenAIServer, answer, drip
from tests.helpers import bounded
from workers import model_calls
from workers.providers import ModelRequest, get_provider

DEADLINE_SECONDS = 1.5


@pytest.fixture
def provider_server(
    configure: Configure, monkeypatch: pytest.MonkeyPatch
) -> Iterator[OpenAIServer]:
    """A fake OpenAI server that the ``openai:`` provider talks to, with a short deadline."""
    from workers.providers import _provider

    with OpenAIServer() as server:
        configure(
            RATCHET_OPENAI_BASE_URL=server.base_url,
            RATCHET_OPENAI_API_KEY="test-key",
            RATCHET_MODEL_TIMEOUT_SECONDS="10",  # each read: the drip sends a byte every 0.1 s
            RATCHET_MODEL_CALL_DEADLINE_SECONDS=str(DEADLINE_SECONDS),
            RATCHET_MODEL_MAX_ATTEMPTS="2",
            RATCHET_MODEL_RETRY_BASE_SECONDS="0",
        )
        monkeypatch.setattr(model_calls, "get_limiter", LocalLimiter)
        _provider.cache_clear()  # its SDK client is made from the settings
        yield server
    _provider.cache_clear()


def complete(failed: list[dict[str, Any]]) -> Any:
    provider, name = get_provider("openai:gpt-4o-mini")
    request = ModelRequest(
        task_id="t",
        step=1,
        model=name,
        messages=[{"role": "user", "content": "hi"}],
        tools=[],
        options={},
    )
    return model_calls.complete(
        provider, request, model="openai:gpt-4o-mini", tenant="t", prior_failures=0, failed=failed
    )


def test_an_attempt_that_never_ends_fails_at_its_deadline_and_is_retried(
    provider_server: OpenAIServer,
) -> None:
    provider_server.reply(drip(), answer("here at last"))
    failed: list[dict[str, Any]] = []
    result, took = bounded(lambda: complete(failed))
    assert not isinstance(result, Exception), result
    assert result.content == "here at last"
    assert [f["error"]["type"] for f in failed] == ["model_unavailable"]
    assert f"{DEADLINE_SECONDS:g} s deadline" in failed[0]["error"]["message"]
    assert took >= DEADLINE_SECONDS


def test_attempts_that_never_end_run_out_as_transient_failures(
    provider_server: OpenAIServer,
) -> None:
    provider_server.reply(drip(), drip())
    failed: list[dict[str, Any]] = []
    result, _ = bounded(lambda: complete(failed))
    assert isinstance(result, ModelTransientError), result
    assert "(after 2 attempts)" in str(result)
    assert len(failed) == 2
    assert len(provider_server.requests) == 2
