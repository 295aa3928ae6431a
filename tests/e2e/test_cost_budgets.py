"""Budgets and honest cost on real API and worker processes: a task stops before the model call
whose worst case could take it past its cost or token budget (the OpenAI-compatible test server
counts each task's calls), cached prompt tokens are billed at the price table's cached price,
and a model with no known price costs null, not $0. A bad prices file stops a process at start
with one line."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory, run_ratchet
from tests.e2e.util import wait_all
from tests.fakes.openai_server import Completion, OpenAIServer, Received, Reply, tool_call

PRICED = "openai:gpt-4o-mini"  # $0.15 in, $0.075 cached in, $0.60 out per million tokens


class Model:
    """Every call asks for the calculator, using 1,000 prompt tokens (800 of them cached) and
    500 answer tokens, until the conversation has three tool results; then it answers.
    Counts the calls per task (by its input)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def __call__(self, request: Received) -> Reply:
        task = next(m["content"] for m in request.messages if m["role"] == "user")
        self.calls[task] += 1
        if sum(m["role"] == "tool" for m in request.messages) >= 3:
            return Completion(content="done", prompt_tokens=1000, completion_tokens=5)
        reply = tool_call("calculator", {"expression": "1+1"})
        return Completion(
            calls=reply.calls, prompt_tokens=1000, completion_tokens=500, cached_tokens=800
        )


def test_budgets_stop_before_the_call_and_cost_is_honest_on_real_workers(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    model = Model()
    options = {"max_tokens": 1000}
    tasks = {
        # One call costs $0.00042; the second's worst case (~$0.0006) would cross $0.001.
        "cost": {"model": PRICED, "budget": {"max_cost_usd": 0.001}},
        # One call uses 1,500 tokens; the second's worst case (~1,050) would cross 2,400.
        "tokens": {"model": PRICED, "budget": {"max_tokens": 2400}},
        "roomy": {"model": PRICED, "budget": {"max_cost_usd": 1.0, "max_tokens": 100_000}},
        "unpriced": {"model": "openai:my-local-llama"},
    }
    with OpenAIServer(responder=model) as llm:
        env = {"RATCHET_OPENAI_BASE_URL": llm.base_url, "RATCHET_OPENAI_API_KEY": "sk-test"}
        fleet = stack(workers=1, concurrency=2, env=env)
        with fleet.client(headers=tenant.headers) as http:
            ids = {}
            for name, spec in tasks.items():
                body = {"input": name, "tools": ["calculator"], "model_options": options} | spec
                response = http.post("/v1/tasks", json=body)
                assert response.status_code == 202, response.text
                ids[name] = response.json()["id"]
            refused = http.post(
                "/v1/tasks",
                json={
                    "input": "x",
                    "model": "openai:my-local-llama",
                    "budget": {"max_cost_usd": 1},
                },
            )
            done = wait_all(http, None, ids.values(), timeout=120)

    assert refused.status_code == 422, refused.text
    assert "RATCHET_PRICES_FILE" in refused.json()["detail"]
    for name in ("cost", "tokens"):
        task = done[ids[name]]
        assert task["status"] == "failed", task
        assert task["error"]["type"] == "budget_exceeded"
        assert "next model call" in task["error"]["message"]
    assert model.calls["cost"] == model.calls["tokens"] == 1  # never the call that could cross
    roomy, unpriced = done[ids["roomy"]], done[ids["unpriced"]]
    assert roomy["status"] == unpriced["status"] == "succeeded"
    assert model.calls["roomy"] == 4
    # Three tool-call turns (200 uncached, 800 cached, 500 out) and the answer (1,000 in, 5 out).
    per_call = (200 * 0.15 + 800 * 0.075 + 500 * 0.60) / 1e6
    expected = 3 * per_call + (1000 * 0.15 + 5 * 0.60) / 1e6
    assert roomy["usage"]["cached_input_tokens"] == 2400
    assert roomy["usage"]["cost_usd"] == pytest.approx(expected)
    assert unpriced["usage"]["cost_usd"] is None
    assert unpriced["usage"]["input_tokens"] == 4000


@pytest.mark.parametrize("command", [("api",), ("worker",)])
def test_a_bad_prices_file_stops_the_process_at_start_in_one_line(
    service_env: dict[str, str], tmp_path: Path, command: tuple[str, ...]
) -> None:
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"models": {"openai:x": {"input": -1, "output": 1}}}))
    env = {**service_env, "RATCHET_PRICES_FILE": str(prices)}
    done = run_ratchet(*command, env=env, cwd=tmp_path, timeout=60)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr + done.stdout
    [line] = done.stderr.strip().splitlines()
    assert "RATCHET_PRICES_FILE" in line
    assert "models.openai:x.input" in line
