"""``anthropic:`` over real HTTP against a Messages-API test server started by the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.conftest import TenantHandle
from tests.fakes.anthropic_server import MessagesServer, message


@pytest.fixture
def anthropic_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., MessagesServer]]:
    from shared.settings import get_settings
    from workers.providers import _provider

    servers: list[MessagesServer] = []

    def start(replies: list[tuple[int, dict[str, Any]]]) -> MessagesServer:
        server = MessagesServer(replies)
        servers.append(server)
        monkeypatch.setenv("RATCHET_ANTHROPIC_BASE_URL", server.url)
        monkeypatch.setenv("RATCHET_ANTHROPIC_API_KEY", "test-key")
        monkeypatch.setenv("RATCHET_MODEL_MAX_ATTEMPTS", "1")
        get_settings.cache_clear()
        _provider.cache_clear()
        return server

    yield start
    for server in servers:
        server.server.shutdown()
    monkeypatch.undo()
    get_settings.cache_clear()
    _provider.cache_clear()


def test_tool_calls_round_trip(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    anthropic_server: Callable[..., MessagesServer],
) -> None:
    server = anthropic_server(
        [
            (
                200,
                message(
                    [
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "calculator",
                            "input": {"expression": "6*7"},
                        }
                    ],
                    "tool_use",
                    tokens=(30, 10),
                ),
            ),
            (200, message([{"type": "text", "text": "It is 42."}], "end_turn", tokens=(50, 5))),
        ]
    )
    body = {
        "input": "What is 6*7?",
        "model": "anthropic:claude-test",
        "tools": ["calculator"],
        "instructions": "Be brief.",
    }
    task_id = client.post("/v1/tasks", json=body, headers=tenant.headers).json()["id"]
    assert drive(task_id) == "succeeded"
    task = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    assert task["result"] == {"output": "It is 42."}
    assert task["usage"]["input_tokens"] == 80
    assert task["usage"]["output_tokens"] == 15

    first, second = (r["body"] for r in server.requests)
    assert all(r["path"] == "/v1/messages" and r["key"] == "test-key" for r in server.requests)
    assert "Be brief." in first["system"]
    assert first["tools"][0]["name"] == "calculator"
    assert first["tools"][0]["input_schema"]["required"] == ["expression"]
    assert second["messages"][1] == {
        "role": "assistant",
        "content": [
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "calculator",
                "input": {"expression": "6*7"},
            }
        ],
    }
    assert second["messages"][2] == {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}],
    }


def test_a_bad_request_fails_the_task_clearly(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    anthropic_server: Callable[..., MessagesServer],
) -> None:
    error = {"type": "error", "error": {"type": "invalid_request_error", "message": "bad model"}}
    server = anthropic_server([(400, error)])
    body = {"input": "hi", "model": "anthropic:claude-test"}
    task_id = client.post("/v1/tasks", json=body, headers=tenant.headers).json()["id"]
    assert drive(task_id) == "failed"
    task = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    assert task["error"]["type"] == "model_rejected"
    assert "400" in task["error"]["message"]
    assert len(server.requests) == 1
