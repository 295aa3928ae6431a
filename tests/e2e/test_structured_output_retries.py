"""``output_schema`` on real worker processes: an invalid first answer is corrected on the second
and the task ends with parsed JSON; one that never validates fails with ``invalid_output`` after
``RATCHET_OUTPUT_RETRIES``. A worker killed (``kill -9``) right after an invalid answer's commit
leaves the answer and its verdict to the next worker: the model is never asked for that step
again (the OpenAI-compatible test server counts each task's calls)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory
from tests.e2e.util import wait_all
from tests.fakes.openai_server import OpenAIServer, Received, Reply, answer

MODEL = "openai:gpt-4o-mini"
SCHEMA = {
    "type": "object",
    "properties": {"total": {"type": "number"}},
    "required": ["total"],
    "additionalProperties": False,
}


class Answers:
    """The model: the task whose input says "corrects" answers invalid JSON first and then a
    valid answer; any other task never gives valid JSON. Counts the calls per task input."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def __call__(self, request: Received) -> Reply:
        task = next(m["content"] for m in request.messages if m["role"] == "user")
        self.calls[task] += 1
        tries = sum(m["role"] == "assistant" for m in request.messages)
        if task == "corrects" and tries:
            return answer('{"total": 12.5}')
        return answer('{"total": "twelve"}')


def test_invalid_answers_are_retried_durably_on_real_workers(
    stack: StackFactory, tenant: TenantHandle, tmp_path: Path
) -> None:
    marker = tmp_path / "killed"
    model = Answers()
    with OpenAIServer(responder=model) as llm:
        env = {
            "RATCHET_OPENAI_BASE_URL": llm.base_url,
            "RATCHET_OPENAI_API_KEY": "sk-test",
            "RATCHET_OUTPUT_RETRIES": "2",
            "RATCHET_LEASE_TTL_SECONDS": "2",
            "RATCHET_SWEEP_INTERVAL_SECONDS": "0.5",
            "RATCHET_SWEEP_GRACE_SECONDS": "1",
            "RATCHET_FAILPOINTS": f"after_model_commit=kill_once:{marker}",
        }
        fleet = stack(workers=2, concurrency=1, env=env)
        with fleet.client(headers=tenant.headers) as http:
            ids = {}
            for task in ("corrects", "never"):
                body = {"input": task, "model": MODEL, "tools": [], "output_schema": SCHEMA}
                response = http.post("/v1/tasks", json=body)
                assert response.status_code == 202, response.text
                ids[task] = response.json()["id"]
            done = wait_all(http, None, ids.values(), timeout=120)
            steps = {
                task: http.get(f"/v1/tasks/{task_id}/steps").json()["items"]
                for task, task_id in ids.items()
            }

    assert marker.exists(), "no worker reached the failpoint"
    corrected, never = done[ids["corrects"]], done[ids["never"]]
    assert corrected["status"] == "succeeded", corrected
    assert corrected["result"] == {"output": {"total": 12.5}}
    assert never["status"] == "failed", never
    assert never["error"]["type"] == "invalid_output"
    assert "after 2 retries" in never["error"]["message"]
    # One call per step, the killed one included: a committed answer is never asked again.
    assert model.calls == {"corrects": 2, "never": 3}
    assert [len(steps["corrects"]), len(steps["never"])] == [2, 3]
    assert all("output_error" in s["model"] for s in steps["never"])
