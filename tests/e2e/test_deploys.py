"""A deploy mid-task, with real processes: a task submitted before a deploy that changes its
agent's system prompt and removes one of its tools keeps its agent version after the deploy
(the workers restarted with the new agent module). Every model request it makes carries the
original prompt and tools, and its call of the removed tool is a clear error the model reads.

The deploy kills the worker mid-step (``kill -9``, while the model is thinking), and a worker
of the new deploy resumes the step: the OpenAI-compatible test server records every request.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.conftest import TenantHandle
from tests.deploys import after, before
from tests.e2e.conftest import StackFactory
from tests.fakes.openai_server import (
    OpenAIServer,
    answer,
    openai_server,  # noqa: F401
    stall,
    tool_call,
)

MODEL = "openai:gpt-deploy-test"
DEPLOY_1 = "tests.sample_agents,tests.deploys.before"
DEPLOY_2 = "tests.sample_agents,tests.deploys.after"
REFUSED = (
    "error: tool 'cancel_order' is not available in this deployment (removed after the task "
    "started); the call was not run"
)


def _wait_for(what: str, check: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _task(http: httpx.Client, task_id: str) -> dict[str, Any]:
    response = http.get(f"/v1/tasks/{task_id}", params={"wait": 30})
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_a_task_keeps_its_agent_version_across_a_deploy(
    stack: StackFactory,
    tenant: TenantHandle,
    openai_server: OpenAIServer,  # noqa: F811
) -> None:
    fleet = stack(
        workers=1,
        env={
            "RATCHET_AGENT_MODULES": DEPLOY_1,
            "RATCHET_OPENAI_BASE_URL": openai_server.base_url,
            "RATCHET_OPENAI_API_KEY": "test-key",
            "RATCHET_LEASE_TTL_SECONDS": "2",
            "RATCHET_SWEEP_INTERVAL_SECONDS": "0.5",
            "RATCHET_SWEEP_GRACE_SECONDS": "1",
        },
    )
    openai_server.reply(
        tool_call("lookup_order", {"order": "7"}, call_id="call_1"),
        stall(60),  # step 2 under the first deploy: the model is thinking when it is killed
        tool_call("cancel_order", {"order": "7"}, call_id="call_2"),
        answer("Order 7 could not be cancelled."),
    )
    http = fleet.client(headers=tenant.headers)
    submitted = http.post(
        "/v1/tasks", json={"agent": "orders", "input": "Cancel 7.", "model": MODEL}
    )
    assert submitted.status_code == 202, submitted.text
    task = submitted.json()
    assert task["agent_version"]

    _wait_for("step 2's model call", lambda: len(openai_server.requests) == 2)
    fleet.kill_worker(0)  # the deploy: the old worker goes, a worker of the new one comes
    fleet.env["RATCHET_AGENT_MODULES"] = DEPLOY_2
    fleet.start_worker()

    done = _task(http, task["id"])
    assert done["status"] == "succeeded", done
    assert done["result"] == {"output": "Order 7 could not be cancelled."}
    assert done["agent_version"] == task["agent_version"]

    requests = openai_server.requests
    assert len(requests) == 4  # the killed step's call asked again, by the new worker
    version = http.get(f"/v1/agents/orders/versions/{task['agent_version']}").json()
    described = {t["name"]: t["description"] for t in version["definition"]["tools"]}
    for sent in requests:
        assert sent.messages[0] == {"role": "system", "content": before.PROMPT}
        tools = {t["function"]["name"]: t["function"]["description"] for t in sent.body["tools"]}
        assert tools == described
    assert described == {
        "lookup_order": "Look an order up by its number.",
        "cancel_order": "Cancel an order by its number.",
    }
    assert after.PROMPT not in str([r.body for r in requests])
    # Step 1's call ran before the deploy; the removed tool's, after it, was refused, and the
    # model read why.
    assert requests[2].messages[-1]["content"] == "order 7: shipped"
    assert requests[3].messages[-1] == {
        "role": "tool",
        "tool_call_id": "call_2",
        "content": REFUSED,
    }

    steps = http.get(f"/v1/tasks/{task['id']}/steps").json()["items"]
    calls = [(c["name"], c["status"]) for s in steps for c in s["tool_calls"]]
    assert calls == [("lookup_order", "succeeded"), ("cancel_order", "failed")]
    assert steps[1]["tool_calls"][0]["error"] == REFUSED.removeprefix("error: ")
