"""A summary of the ``summarize`` context policy is committed once: a worker killed (``kill -9``)
right after a summary's commit, before the model call that uses it, leaves it to the next
worker, which reads it back and never asks for it again (the test server counts the
summarizing calls), and every prompt of the task stays inside the model's window."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory
from tests.e2e.util import wait_all
from tests.fakes.openai_server import OpenAIServer
from tests.fakes.reader import Reader, unpaired_calls

MODEL = "openai:reader-small"
WINDOW = 4_000
PAGES = 30  # enough for a few summaries in a window of 4,000 tokens


def test_a_kill_right_after_a_summary_commit_reuses_the_summary(
    stack: StackFactory, tenant: TenantHandle, tmp_path: Path
) -> None:
    marker = tmp_path / "killed"
    reader = Reader(last_page=PAGES)
    with OpenAIServer(responder=reader) as llm:
        env = {
            "RATCHET_OPENAI_BASE_URL": llm.base_url,
            "RATCHET_OPENAI_API_KEY": "sk-test",
            "RATCHET_MODEL_CONTEXT_WINDOWS": json.dumps({MODEL: WINDOW}),
            "RATCHET_LEASE_TTL_SECONDS": "2",
            "RATCHET_SWEEP_INTERVAL_SECONDS": "0.5",
            "RATCHET_SWEEP_GRACE_SECONDS": "1",
            "RATCHET_FAILPOINTS": f"after_summary_commit=kill_once:{marker}",
        }
        fleet = stack(workers=2, concurrency=1, env=env)
        body = {
            "input": "Read the book.",
            "agent": "reader",
            "model": MODEL,
            "max_steps": 100,
            "context": {"policy": "summarize"},
        }
        with fleet.client(headers=tenant.headers) as http:
            response = http.post("/v1/tasks", json=body)
            assert response.status_code == 202, response.text
            task_id = response.json()["id"]
            task = wait_all(http, None, [task_id], timeout=120)[task_id]
            steps = http.get(f"/v1/tasks/{task_id}/steps", params={"limit": 200}).json()

    assert marker.exists(), "no worker reached the failpoint"
    assert task["status"] == "succeeded", task
    summaries = steps["summaries"]
    assert len(summaries) >= 2
    # One summarizing call per committed summary: the one whose commit the kill followed was
    # read back, not asked for again.
    assert len(reader.summary_sizes) == len(summaries)
    assert [s["content"] for s in summaries] == [
        f"Summary {n}: the agent is reading the book." for n in range(1, len(summaries) + 1)
    ]
    # And the step's own call, which the kill came before, was made once, as every other.
    assert len(reader.sizes) == task["steps"] == PAGES + 1
    assert max(reader.sizes) + WINDOW // 4 <= WINDOW
    for prompt in reader.prompts:
        assert unpaired_calls(prompt) == []
