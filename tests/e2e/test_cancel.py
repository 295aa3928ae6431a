"""Cancellation reaches a step in flight: a real API and worker over HTTP.

A cancel does not wait for the step's next commit: the step stops waiting on its tool or its
model, and the task is cancelled at once. Before the cancel lands, the Task shows it pending.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory
from tests.e2e.util import wait_all
from tests.helpers import calculator_script, scripted_task, tool_turn

# Far longer than the bound below: had the cancel waited for the step, the test would fail.
SLEEP_SECONDS = 600
MODEL_DELAY_MS = 50_000
# The cancel lands within about a second; the bound leaves room for a loaded machine.
LANDS_WITHIN_SECONDS = 10.0


def submit(http: httpx.Client, body: dict[str, Any]) -> str:
    response = http.post("/v1/tasks", json=body)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def wait_until(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.1)


def event_types(http: httpx.Client, task_id: str) -> list[str]:
    """The events of a task that has ended (the stream ends with it)."""
    response = http.get(f"/v1/tasks/{task_id}/events")
    lines = response.text.splitlines()
    return [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]


def tool_call_started(http: httpx.Client, task_id: str) -> bool:
    steps = http.get(f"/v1/tasks/{task_id}/steps").json()["items"]
    return bool(steps and steps[0]["tool_calls"])


def cancel_and_time_it(http: httpx.Client, task_id: str) -> tuple[dict[str, Any], float]:
    """Cancel a running task; the Task as the cancel answered it, and how long it took to
    land (from the request to the task seen ``cancelled``)."""
    started = time.monotonic()
    response = http.post(f"/v1/tasks/{task_id}/cancel")
    assert response.status_code == 202, response.text

    def landed() -> bool:
        return bool(http.get(f"/v1/tasks/{task_id}").json()["status"] == "cancelled")

    wait_until(f"the cancel of {task_id}", landed, timeout=LANDS_WITHIN_SECONDS)
    return response.json(), time.monotonic() - started


def test_a_cancel_stops_a_sleeping_tool_and_a_thinking_model(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    # The sleep runs its 600 s unless cancelled: the tools' time limit is longer.
    fleet = stack(workers=1, concurrency=1, env={"RATCHET_TOOL_TIMEOUT_SECONDS": "900"})
    http = fleet.client(tenant.headers)
    sleeper = submit(
        http,
        scripted_task([tool_turn("sleep", seconds=SLEEP_SECONDS), {"content": "woke"}])
        | {"tools": ["sleep"]},
    )
    thinker = submit(http, scripted_task([{"content": "late", "delay_ms": MODEL_DELAY_MS}]))
    wait_until("the sleep call", lambda: tool_call_started(http, sleeper))
    wait_until(
        "the slow model call",
        lambda: http.get(f"/v1/tasks/{thinker}").json()["status"] == "running",
    )

    for task_id in (sleeper, thinker):
        answered, took = cancel_and_time_it(http, task_id)

        # Pending while the step was in flight; gone once it landed.
        assert answered["status"] == "running", answered
        assert answered["cancel_requested_at"] is not None, answered
        task = http.get(f"/v1/tasks/{task_id}").json()
        assert task["error"]["type"] == "cancelled", task
        assert task["cancel_requested_at"] is None, task
        assert took < LANDS_WITHIN_SECONDS, took

    # The abandoned call says so in the timeline; the model's answer was never recorded.
    steps = http.get(f"/v1/tasks/{sleeper}/steps").json()["items"]
    (call,) = steps[0]["tool_calls"]
    assert call["status"] == "failed", call
    assert "cancelled" in call["error"], call
    assert http.get(f"/v1/tasks/{thinker}/steps").json()["items"] == []
    assert event_types(http, sleeper)[-1] == "task.cancelled"

    # The worker goes on with other work at once.
    after = submit(http, scripted_task(calculator_script(2)) | {"tools": ["calculator"]})
    assert wait_all(http, None, [after], timeout=60)[after]["status"] == "succeeded"
