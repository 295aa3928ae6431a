"""A stalled worker asks no model for a lease it may have lost (no services needed)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from shared.errors import LeaseLost
from shared.store.leases import Lease
from workers import heartbeat, model_calls
from workers.providers import ModelRequest, ModelResponse


def lease(ttl_ms: int = 3_000) -> Lease:
    return Lease(task_id="t", epoch=1, owner="w", step=1, attempt=1, ttl_ms=ttl_ms)


def test_a_lease_is_held_while_kept_and_fresh_and_not_once_stale_or_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(heartbeat, "_ensure_thread", lambda: None)  # no database here
    held = lease()
    assert heartbeat.holding(held)  # a step run outside a worker: taken at its word
    with heartbeat.kept(held):
        assert heartbeat.holding(held)
        entry = heartbeat._leases[id(held)]
        # Last extended more than half a TTL ago: this process stalled; it may be lost.
        heartbeat._leases[id(held)] = (held, entry[1], time.monotonic() - 1.6)
        assert not heartbeat.holding(held)
        heartbeat._leases[id(held)] = (held, entry[1], heartbeat.LOST)
        assert not heartbeat.holding(held)
    assert id(held) not in heartbeat._leases  # let go when its step ends


class CountingProvider:
    def __init__(self) -> None:
        self.calls = 0

    def complete(self, request: ModelRequest) -> ModelResponse:
        self.calls += 1
        return ModelResponse(content="ok", tool_calls=[], input_tokens=1, output_tokens=1)


def request() -> ModelRequest:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    return ModelRequest(task_id="t", step=1, model="m", messages=messages, tools=[], options={})


def test_no_model_is_asked_for_a_lease_that_may_be_lost() -> None:
    provider = CountingProvider()
    with pytest.raises(LeaseLost):
        model_calls.limited_call(
            provider, request(), model="scripted:m", tenant="t", still_held=lambda: False
        )
    assert provider.calls == 0
    answer = model_calls.limited_call(provider, request(), model="scripted:m", tenant="t")
    assert (answer.content, provider.calls) == ("ok", 1)
