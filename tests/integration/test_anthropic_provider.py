"""``anthropic:`` over real HTTP against a Messages-API test server started by the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.conftest import TenantHandle
from tests.fakes.anthropic_server import (
    MessagesServer,
    cache_breakpoints,
    message,
    redacted_thinking,
    text,
    thinking,
    tool_use,
)


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
    assert "Be brief." in first["system"][0]["text"]
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
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": "42",
                "cache_control": {"type": "ephemeral"},
            }
        ],
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


# --- prompt caching ---------------------------------------------------------------------------

PRICED = "anthropic:claude-sonnet-4-5"


def _calculator_then_answer(**usage: Any) -> list[tuple[int, dict[str, Any]]]:
    return [
        (200, message([tool_use("calculator", {"expression": "6*7"})], "tool_use", **usage)),
        (200, message([text("It is 42.")], "end_turn", **usage)),
    ]


def _submit(client: TestClient, tenant: TenantHandle, **body: Any) -> str:
    sent = {"input": "What is 6*7?", "model": PRICED, "tools": ["calculator"]} | body
    response = client.post(
        "/v1/tasks", json=sent | {"instructions": "Be brief."}, headers=tenant.headers
    )
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def test_the_stable_prefix_and_the_conversation_so_far_are_marked_for_the_cache(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    anthropic_server: Callable[..., MessagesServer],
) -> None:
    server = anthropic_server(_calculator_then_answer(tokens=(30, 10)))
    assert drive(_submit(client, tenant)) == "succeeded"

    first, second = (r["body"] for r in server.requests)
    assert cache_breakpoints(first) == ["system[0]", "tools[0]", "messages[0].content[0]"]
    assert first["system"] == [
        {"type": "text", "text": first["system"][0]["text"], "cache_control": {"type": "ephemeral"}}
    ]
    assert "Be brief." in first["system"][0]["text"]
    assert first["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is 6*7?", "cache_control": {"type": "ephemeral"}}
            ],
        }
    ]
    # The next step marks its own last block: what the step before wrote, it now reads.
    assert cache_breakpoints(second) == ["system[0]", "tools[0]", "messages[2].content[0]"]
    assert second["messages"][2]["content"][0]["type"] == "tool_result"


@pytest.mark.parametrize(
    ("setting", "option"), [("false", None), ("true", False)], ids=["setting", "model_option"]
)
def test_prompt_caching_can_be_turned_off(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    anthropic_server: Callable[..., MessagesServer],
    monkeypatch: pytest.MonkeyPatch,
    setting: str,
    option: bool | None,
) -> None:
    from shared.settings import get_settings

    server = anthropic_server(_calculator_then_answer(tokens=(30, 10)))
    monkeypatch.setenv("RATCHET_ANTHROPIC_PROMPT_CACHING", setting)
    get_settings.cache_clear()
    options = {} if option is None else {"model_options": {"prompt_caching": option}}
    assert drive(_submit(client, tenant, **options)) == "succeeded"

    assert [cache_breakpoints(r["body"]) for r in server.requests] == [[], []]
    assert all(isinstance(r["body"]["system"], str) for r in server.requests)
    assert all("prompt_caching" not in r["body"] for r in server.requests)


def test_cached_tokens_are_in_the_usage_and_cost_what_the_price_table_says(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    anthropic_server: Callable[..., MessagesServer],
) -> None:
    from shared.pricing import price_of

    # Anthropic counts the prompt's uncached tokens apart from those read from and written to
    # the cache: Ratchet's input_tokens is the whole prompt.
    anthropic_server(
        [
            (
                200,
                message(
                    [tool_use("calculator", {"expression": "6*7"})],
                    "tool_use",
                    tokens=(100, 20),
                    cache_write=2000,
                ),
            ),
            (
                200,
                message([text("It is 42.")], "end_turn", tokens=(150, 10), cache_read=2000),
            ),
        ]
    )
    task_id = _submit(client, tenant)
    assert drive(task_id) == "succeeded"

    price = price_of(PRICED)
    assert price is not None
    assert price.cached_input is not None
    assert price.cache_write is not None
    assert price.cached_input < price.input < price.cache_write  # 0.1x and 1.25x the input
    first = (100 * price.input + 2000 * price.cache_write + 20 * price.output) / 1e6
    second = (150 * price.input + 2000 * price.cached_input + 10 * price.output) / 1e6
    task = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    assert task["usage"] == {
        "input_tokens": 2100 + 2150,
        "output_tokens": 30,
        "cached_input_tokens": 2000,
        "cache_write_tokens": 2000,
        "reasoning_tokens": 0,
        "cost_usd": pytest.approx(first + second),
    }
    # Read from the cache, the second prompt cost a tenth of what it would have uncached.
    uncached = (4250 * price.input + 30 * price.output) / 1e6
    assert task["usage"]["cost_usd"] < uncached
    steps = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()["items"]
    assert [
        (
            s["usage"]["input_tokens"],
            s["usage"]["cached_input_tokens"],
            s["usage"]["cache_write_tokens"],
        )
        for s in steps
    ] == [(2100, 0, 2000), (2150, 2000, 0)]
    assert [s["usage"]["cost_usd"] for s in steps] == [pytest.approx(first), pytest.approx(second)]
    page = _dashboard_page(client, tenant, f"/dashboard/tasks/{task_id}")
    assert "4,250 in (2,000 cached) (2,000 written to cache) / 30 out" in page


def _dashboard_page(client: TestClient, tenant: TenantHandle, path: str) -> str:
    """A dashboard page, as an admin of ``tenant`` sees it."""
    from shared.store.db import transaction
    from shared.store.tables import Tenant
    from shared.store.tenants import create_key

    with transaction() as session:
        key = create_key(session, session.get_one(Tenant, tenant.id), ("admin",))
    client.post("/dashboard/login", data={"key": key}, follow_redirects=False)
    page = client.get(path)
    assert page.status_code == 200, page.text
    return page.text


# --- extended thinking ------------------------------------------------------------------------


def test_thinking_blocks_go_back_verbatim_on_the_turn_after_a_tool_call(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    anthropic_server: Callable[..., MessagesServer],
) -> None:
    thought = thinking("The user wants 6*7: use the calculator.", "sig-EqQBCgIYAhIM1")
    hidden = redacted_thinking("EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3")
    server = anthropic_server(
        [
            (
                200,
                message(
                    [thought, hidden, tool_use("calculator", {"expression": "6*7"})],
                    "tool_use",
                    tokens=(40, 60),
                    thinking_tokens=45,
                ),
            ),
            (
                200,
                message(
                    [thinking("42 it is.", "sig-2"), text("It is 42.")],
                    "end_turn",
                    tokens=(90, 12),
                    thinking_tokens=6,
                ),
            ),
        ]
    )
    setting = {"type": "enabled", "budget_tokens": 2048}
    task_id = _submit(client, tenant, model_options={"thinking": setting, "max_tokens": 4096})
    assert drive(task_id) == "succeeded"

    first, second = (r["body"] for r in server.requests)
    assert [first["thinking"], second["thinking"]] == [setting, setting]
    # The server refuses a tool-use turn that does not start with its thinking, as given.
    assistant = second["messages"][1]
    assert assistant["role"] == "assistant"
    assert assistant["content"] == [thought, hidden, tool_use("calculator", {"expression": "6*7"})]

    task = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    assert task["result"] == {"output": "It is 42."}
    assert (task["usage"]["output_tokens"], task["usage"]["reasoning_tokens"]) == (72, 51)
    steps = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()["items"]
    assert steps[0]["model"]["thinking"] == [thought, hidden]
    assert steps[1]["model"]["thinking"] == [thinking("42 it is.", "sig-2")]
    page = _dashboard_page(client, tenant, f"/dashboard/tasks/{task_id}")
    assert "The user wants 6*7: use the calculator." in page
    assert "redacted thinking" in page
    assert "(51 reasoning)" in page


def test_the_server_refuses_a_tool_turn_without_its_thinking() -> None:
    """The test server holds Ratchet to the API's rule (so the test above proves it is kept)."""
    import anthropic as sdk

    thought = thinking("hmm", "sig-1")
    with MessagesServer(
        [
            (
                200,
                message(
                    [thought, tool_use("calculator", {"expression": "1"})],
                    "tool_use",
                    tokens=(1, 1),
                ),
            )
        ]
    ) as server:
        api = sdk.Anthropic(api_key="k", base_url=server.url, max_retries=0)
        setting: Any = {"type": "enabled", "budget_tokens": 1024}
        api.messages.create(
            model="claude-test",
            max_tokens=2048,
            thinking=setting,
            messages=[{"role": "user", "content": "hi"}],
        )
        turns: Any = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [tool_use("calculator", {"expression": "1"})]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"}],
            },
        ]
        with pytest.raises(sdk.BadRequestError, match="must start with a thinking block"):
            api.messages.create(
                model="claude-test", max_tokens=2048, thinking=setting, messages=turns
            )
