"""A task's budget is kept before each model call, not only after it: a task stops before the
call whose worst case (its prompt and all its answer may use) could take it past its budget,
so it never overshoots by a whole call; an OpenAI-compatible server counts the calls. A cost
budget on a model with no known price is refused at submission."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.conftest import TenantHandle
from tests.fakes.openai_server import (
    OpenAIServer,
    answer,
    tool_call,
)
from tests.integration.test_api import assert_problem, error_fields

MODEL = "openai:gpt-4o-mini"  # $0.15 in, $0.60 out per million tokens
ANSWER_CAP = 1000  # model_options.max_tokens: the most an answer may use


def _submit(client: TenantClient, **body: Any) -> str:
    http, tenant = client
    sent = {
        "input": "Add 1 and 1, again and again.",
        "model": MODEL,
        "tools": ["calculator"],
        "model_options": {"max_tokens": ANSWER_CAP},
    } | body
    response = http.post("/v1/tasks", json=sent, headers=tenant.headers)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


TenantClient = tuple[TestClient, TenantHandle]


@pytest.fixture
def api(client: TestClient, tenant: TenantHandle) -> TenantClient:
    return client, tenant


# Each call the server answers uses 1,000 prompt tokens and 500 answer tokens: $0.00045 and
# 1,500 tokens. Before the second call the task has spent that, and the second call's worst
# case (a short prompt and 1,000 answer tokens, ~$0.0006) would take it past either budget
# below, though the first call alone is within it. Checked only after each call, the task
# would have made the second call, and the third, and crossed the budget by a whole call.
@pytest.mark.parametrize(
    ("budget", "told"),
    [({"max_cost_usd": 0.001}, "$"), ({"max_tokens": 2400}, "tokens")],
    ids=["cost", "tokens"],
)
def test_a_task_stops_before_the_call_that_could_cross_its_budget(
    api: TenantClient,
    drive: Callable[..., str],
    openai_provider: OpenAIServer,
    budget: dict[str, float],
    told: str,
) -> None:
    openai_provider.reply(
        *[
            tool_call(
                "calculator", {"expression": "1+1"}, prompt_tokens=1000, completion_tokens=500
            )
            for _ in range(5)
        ]
    )
    task_id = _submit(api, budget=budget)

    assert drive(task_id) == "failed"

    assert len(openai_provider.requests) == 1  # the second call was never made
    http, tenant = api
    task = http.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    assert task["error"]["type"] == "budget_exceeded"
    assert "next model call" in task["error"]["message"]
    assert told in task["error"]["message"]
    assert task["usage"]["input_tokens"] + task["usage"]["output_tokens"] == 1500
    assert task["usage"]["cost_usd"] == pytest.approx((1000 * 0.15 + 500 * 0.60) / 1e6)
    # The first step's tool ran: the task stopped before the next model call, not mid-step.
    steps = http.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()["items"]
    assert [c["status"] for c in steps[0]["tool_calls"]] == ["succeeded"]


def test_a_budget_with_room_for_every_worst_case_is_never_in_the_way(
    api: TenantClient, drive: Callable[..., str], openai_provider: OpenAIServer
) -> None:
    openai_provider.reply(
        tool_call("calculator", {"expression": "1+1"}, prompt_tokens=1000, completion_tokens=500),
        answer("2", prompt_tokens=1100, completion_tokens=5),
    )
    task_id = _submit(api, budget={"max_cost_usd": 0.01, "max_tokens": 10_000})
    assert drive(task_id) == "succeeded"
    assert len(openai_provider.requests) == 2


def test_a_budget_too_small_for_one_call_makes_none(
    api: TenantClient, drive: Callable[..., str], openai_provider: OpenAIServer
) -> None:
    task_id = _submit(api, budget={"max_tokens": ANSWER_CAP})  # no room for a prompt too
    assert drive(task_id) == "failed"
    assert openai_provider.requests == []
    http, tenant = api
    task = http.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    assert task["error"]["type"] == "budget_exceeded"
    assert task["usage"]["input_tokens"] == 0


def test_a_cost_budget_on_a_model_with_no_price_is_refused(
    api: TenantClient, openai_provider: OpenAIServer
) -> None:
    http, tenant = api
    body = {"input": "hi", "model": "openai:my-local-llama", "budget": {"max_cost_usd": 1.0}}
    response = http.post("/v1/tasks", json=body, headers=tenant.headers)

    problem = assert_problem(response, 422)
    assert error_fields(problem) == ["budget.max_cost_usd"]
    assert "openai:my-local-llama" in problem["detail"]
    assert "RATCHET_PRICES_FILE" in problem["detail"]
    listed = http.get("/v1/tasks", headers=tenant.headers).json()["items"]
    assert listed == []  # nothing was created
    # A token budget needs no price.
    body["budget"] = {"max_tokens": 10_000}
    assert http.post("/v1/tasks", json=body, headers=tenant.headers).status_code == 202
