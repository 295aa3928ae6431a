"""``openai:`` models against an OpenAI-compatible server on real HTTP: what goes over the wire,
what comes back onto the task, and how provider failures end (or do not end) a task."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.conftest import TenantHandle
from tests.fakes.openai_server import (
    OpenAIServer,
    answer,
    error,
    openai_server,  # noqa: F401
    stall,
    tool_call,
)

MODEL = "openai:gpt-4o-mini"
MAX_ATTEMPTS = 2
Configure = Callable[..., None]


def _fresh_settings() -> None:
    from shared.settings import get_settings
    from workers.providers import _provider

    get_settings.cache_clear()
    _provider.cache_clear()  # the provider holds a client built from the old settings


@pytest.fixture
def configure(service_env: dict[str, str]) -> Iterator[Configure]:
    """Set ``RATCHET_*`` settings for this test (``configure(model_max_attempts=2)``)."""
    with pytest.MonkeyPatch.context() as patch:

        def apply(**values: object) -> None:
            for name, value in values.items():
                patch.setenv(f"RATCHET_{name.upper()}", str(value))
            _fresh_settings()

        yield apply
    _fresh_settings()


@pytest.fixture
def fake(openai_server: OpenAIServer, configure: Configure) -> OpenAIServer:  # noqa: F811
    """The test server, with the openai provider pointed at it."""
    configure(
        openai_base_url=openai_server.base_url,
        openai_api_key="test-key",
        model_max_attempts=MAX_ATTEMPTS,
        model_timeout_seconds=10,
    )
    return openai_server


def _submit(client: TestClient, tenant: TenantHandle, **body: Any) -> str:
    response = client.post(
        "/v1/tasks",
        json={"input": "What is 6*7?", "model": MODEL, "tools": ["calculator"]} | body,
        headers=tenant.headers,
    )
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _task(client: TestClient, tenant: TenantHandle, task_id: str) -> dict[str, Any]:
    response = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _steps(client: TestClient, tenant: TenantHandle, task_id: str) -> list[dict[str, Any]]:
    response = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers)
    assert response.status_code == 200, response.text
    return list(response.json()["items"])


def test_a_tool_call_round_trips_through_the_provider(
    fake: OpenAIServer, client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    from shared.agents.registry import get_registry

    fake.reply(
        tool_call(
            "calculator",
            {"expression": "6*7"},
            call_id="call_abc123",
            prompt_tokens=120,
            completion_tokens=17,
        ),
        answer("The answer is 42.", prompt_tokens=160, completion_tokens=8),
    )
    task_id = _submit(client, tenant)

    assert drive(task_id) == "succeeded"

    first, second = fake.requests
    for sent in (first, second):
        assert sent.method == "POST"
        assert sent.path == "/v1/chat/completions"
        assert sent.headers["authorization"] == "Bearer test-key"
        assert sent.body["model"] == "gpt-4o-mini"
        assert sent.body["tools"] == [
            {
                "type": "function",
                "function": {
                    "name": "calculator",
                    "description": get_registry().tools["calculator"].description,
                    "parameters": get_registry().tools["calculator"].parameters_schema,
                },
            }
        ]
    schema = first.body["tools"][0]["function"]["parameters"]
    assert schema["type"] == "object"
    assert schema["properties"]["expression"]["type"] == "string"
    assert schema["required"] == ["expression"]

    assert first.messages[0]["role"] == "system"
    assert first.messages[1:] == [{"role": "user", "content": "What is 6*7?"}]
    assert second.messages[: len(first.messages)] == first.messages
    assistant, tool_result = second.messages[len(first.messages) :]
    assert assistant["role"] == "assistant"
    [asked] = assistant["tool_calls"]
    assert asked["id"] == "call_abc123"
    assert asked["type"] == "function"
    assert asked["function"]["name"] == "calculator"
    assert json.loads(asked["function"]["arguments"]) == {"expression": "6*7"}
    assert tool_result == {"role": "tool", "tool_call_id": "call_abc123", "content": "42"}

    task = _task(client, tenant, task_id)
    assert task["result"] == {"output": "The answer is 42."}
    assert task["steps"] == 2
    assert task["model"] == MODEL
    assert task["usage"]["input_tokens"] == 120 + 160
    assert task["usage"]["output_tokens"] == 17 + 8
    # gpt-4o-mini lists at $0.15 in and $0.60 out per million tokens.
    assert task["usage"]["cost_usd"] == pytest.approx((280 * 0.15 + 25 * 0.60) / 1e6)

    steps = _steps(client, tenant, task_id)
    assert [s["status"] for s in steps] == ["completed", "completed"]
    assert [(s["usage"]["input_tokens"], s["usage"]["output_tokens"]) for s in steps] == [
        (120, 17),
        (160, 8),
    ]
    [call] = steps[0]["tool_calls"]
    assert (call["name"], call["arguments"], call["status"], call["result"]) == (
        "calculator",
        {"expression": "6*7"},
        "succeeded",
        42,
    )
    assert steps[1]["tool_calls"] == []
    assert steps[1]["model"]["content"] == "The answer is 42."


def test_a_server_error_on_every_attempt_fails_the_task_clearly(
    fake: OpenAIServer, client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    fake.reply(*[error(500, "the upstream blew up")] * (MAX_ATTEMPTS + 3))
    task_id = _submit(client, tenant)

    assert drive(task_id) == "failed"

    assert len(fake.requests) == MAX_ATTEMPTS
    task = _task(client, tenant, task_id)
    assert task["error"]["type"] == "model_unavailable"
    assert "500" in task["error"]["message"]
    assert "the upstream blew up" in task["error"]["message"]
    assert task["result"] is None
    assert _steps(client, tenant, task_id) == []


def test_a_bad_request_fails_at_once(
    fake: OpenAIServer, client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    fake.reply(error(400, "Invalid 'messages[1].content'"), answer("never sent"))
    task_id = _submit(client, tenant)

    assert drive(task_id) == "failed"

    assert len(fake.requests) == 1
    task = _task(client, tenant, task_id)
    assert task["error"]["type"] == "model_rejected"
    assert "400" in task["error"]["message"]
    assert "Invalid 'messages[1].content'" in task["error"]["message"]


def test_a_provider_that_stalls_past_the_timeout_fails_the_task_clearly(
    fake: OpenAIServer,
    configure: Configure,
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
) -> None:
    configure(model_timeout_seconds=0.5)
    fake.reply(*[stall(5, then=answer("too late"))] * MAX_ATTEMPTS)
    task_id = _submit(client, tenant)

    started = time.monotonic()
    assert drive(task_id) == "failed"
    elapsed = time.monotonic() - started

    assert len(fake.requests) == MAX_ATTEMPTS
    assert MAX_ATTEMPTS * 0.5 <= elapsed < 4, "each attempt should give up after the timeout"
    task = _task(client, tenant, task_id)
    assert task["error"]["type"] == "model_unavailable"
    assert "timed out" in task["error"]["message"]


def test_a_transient_server_error_is_retried(
    fake: OpenAIServer, client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    fake.reply(error(500), answer("Second time lucky.", prompt_tokens=40, completion_tokens=5))
    task_id = _submit(client, tenant)

    assert drive(task_id) == "succeeded"

    first, second = fake.requests
    assert second.body == first.body, "a retry sends the same request again"
    task = _task(client, tenant, task_id)
    assert task["result"] == {"output": "Second time lucky."}
    assert task["steps"] == 1
    assert (task["usage"]["input_tokens"], task["usage"]["output_tokens"]) == (40, 5)


def test_a_rate_limit_waits_as_long_as_retry_after_says(
    fake: OpenAIServer, client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    fake.reply(error(429, "slow down", headers={"Retry-After": "1"}), answer("Done."))
    task_id = _submit(client, tenant)

    assert drive(task_id) == "succeeded"

    first, second = fake.requests
    assert second.at - first.at >= 1.0
    assert _task(client, tenant, task_id)["result"] == {"output": "Done."}


def test_text_the_store_cannot_hold_from_the_model_is_kept_spelled_out(
    fake: OpenAIServer, client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    # A model talked into writing a NUL (or a lone surrogate) must not make its checkpoint
    # fail on every attempt: PostgreSQL's jsonb holds neither.
    fake.reply(
        tool_call("calculator", {"expression": "6*7\u0000", "note\u0000": "\ud800"}),
        answer("The answer\u0000 is 42."),
    )
    task_id = _submit(client, tenant)

    assert drive(task_id) == "succeeded"
    task = _task(client, tenant, task_id)
    assert task["result"] == {"output": "The answer\\x00 is 42."}
    (first, _) = _steps(client, tenant, task_id)
    (call,) = first["tool_calls"]
    assert call["arguments"] == {"expression": "6*7\\x00", "note\\x00": "\\ud800"}
