"""Honest cost over real HTTP with an OpenAI-compatible server: cached prompt tokens and
reasoning tokens are read and counted, the cached ones billed at the price table's cached
price; a model with no known price costs an unknown amount (null), not $0, until a prices
file prices it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.conftest import Configure, TenantHandle
from tests.fakes.openai_server import (
    Completion,
    OpenAIServer,
    tool_call,
)
from tests.integration.conftest import fresh_providers

Start = Callable[..., OpenAIServer]


@pytest.fixture
def fake(openai_provider: OpenAIServer, configure: Configure) -> Start:
    """Starts the provider's test server with these settings besides."""

    def start(**env: str) -> OpenAIServer:
        configure(**env)
        fresh_providers()  # its client was made from the settings before
        return openai_provider

    return start


def _run(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    model: str,
    **extra: Any,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    body = {"input": "What is 6*7?", "model": model, "tools": ["calculator"]} | extra
    response = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert response.status_code == 202, response.text
    task_id = response.json()["id"]
    assert drive(task_id) == "succeeded"
    task = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    steps = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()["items"]
    return task, steps


def test_cached_and_reasoning_tokens_are_counted_and_cached_ones_cost_less(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], fake: Start
) -> None:
    from shared.pricing import price_of

    server = fake()
    server.reply(
        tool_call("calculator", {"expression": "6*7"}, prompt_tokens=2000, completion_tokens=300),
        Completion(
            content="42",
            prompt_tokens=2100,
            completion_tokens=200,
            cached_tokens=1920,
            reasoning_tokens=150,
        ),
    )
    options = {"reasoning_effort": "low"}
    task, steps = _run(client, tenant, drive, "openai:gpt-4o-mini", model_options=options)
    assert [r.body["reasoning_effort"] for r in server.requests] == ["low", "low"]

    price = price_of("openai:gpt-4o-mini")
    assert price is not None
    assert price.cached_input == price.input / 2  # OpenAI bills a cached prompt token at half
    expected = (2000 * price.input + 300 * price.output) / 1e6 + (
        180 * price.input + 1920 * price.cached_input + 200 * price.output
    ) / 1e6
    assert task["usage"] == {
        "input_tokens": 4100,
        "output_tokens": 500,
        "cached_input_tokens": 1920,
        "cache_write_tokens": 0,
        "reasoning_tokens": 150,
        "cost_usd": pytest.approx(expected),
    }
    assert [(s["usage"]["cached_input_tokens"], s["usage"]["reasoning_tokens"]) for s in steps] == [
        (0, 0),
        (1920, 150),
    ]


def test_a_model_with_no_price_has_an_unknown_cost_until_a_prices_file_prices_it(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    fake: Start,
    tmp_path: Path,
) -> None:
    model = "openai:my-local-llama"
    server = fake()
    server.reply(
        tool_call("calculator", {"expression": "6*7"}, prompt_tokens=100, completion_tokens=10),
        Completion(content="42", prompt_tokens=120, completion_tokens=5),
    )
    task, steps = _run(client, tenant, drive, model)
    assert task["usage"]["cost_usd"] is None
    assert task["usage"]["input_tokens"] == 220
    assert [s["usage"]["cost_usd"] for s in steps] == [None, None]

    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"models": {model: {"input": 1.0, "output": 2.0}}}))
    server = fake(RATCHET_PRICES_FILE=str(prices))
    server.reply(
        tool_call("calculator", {"expression": "6*7"}, prompt_tokens=100, completion_tokens=10),
        Completion(content="42", prompt_tokens=120, completion_tokens=5),
    )
    task, _ = _run(client, tenant, drive, model)
    assert task["usage"]["cost_usd"] == pytest.approx((220 * 1.0 + 15 * 2.0) / 1e6)


def test_the_openapi_document_describes_the_usage(client: TestClient) -> None:
    usage = client.get("/openapi.json").json()["components"]["schemas"]["Usage"]["properties"]
    for key in ("cached_input_tokens", "cache_write_tokens", "reasoning_tokens"):
        assert usage[key]["type"] == "integer"
        assert usage[key]["description"]
    assert {"type": "null"} in usage["cost_usd"]["anyOf"]
    assert "no known price" in usage["cost_usd"]["description"]
