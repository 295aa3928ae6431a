"""A tenant's calculator bombs do not hold up another tenant's work on the same worker.

One worker process (one prefork child, a few step threads) runs both tenants' tasks. A
big-integer power runs in C holding the interpreter's lock, so had the calculator computed
``(9**9999)**9999`` (a quarter of an hour of one core) every thread of that process would have
stopped with it: the other tenant's steps, the heartbeat, the dispatcher. The bound on the
quiet tenant's tasks sits far from both sides: they take about a second, a bomb minutes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory
from tests.e2e.util import wait_all
from tests.helpers import scripted_task, tool_turn

BOMBS = ["(9**9999)**9999", "(8**9999)**9999", "((9**9999)**9999)**9999"]
QUIET_TASKS = 5
QUIET_WITHIN_SECONDS = 20.0
STARTED_WITHIN_SECONDS = 60.0


def submit(http: httpx.Client, body: dict[str, Any]) -> str:
    response = http.post("/v1/tasks", json=body)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def wait_until(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.1)


def bomb_reached(http: httpx.Client, task_id: str) -> bool:
    """The bomb's call has started (or already ended, with its task)."""
    if http.get(f"/v1/tasks/{task_id}").json()["status"] in ("succeeded", "failed"):
        return True
    steps = http.get(f"/v1/tasks/{task_id}/steps").json()["items"]
    return bool(steps and steps[0]["tool_calls"])


def test_calculator_bombs_leave_another_tenants_tasks_on_time(
    stack: StackFactory, make_tenant: Callable[..., TenantHandle]
) -> None:
    hostile, quiet = make_tenant(), make_tenant()
    fleet = stack(workers=1, concurrency=1, env={"RATCHET_WORKER_THREADS": "4"})
    attacker, neighbour = fleet.client(hostile.headers), fleet.client(quiet.headers)
    bombs = [
        submit(
            attacker,
            scripted_task([tool_turn("calculator", expression=bomb)]) | {"tools": ["calculator"]},
        )
        for bomb in BOMBS
    ]
    wait_until(
        "the first bomb's call", lambda: bomb_reached(attacker, bombs[0]), STARTED_WITHIN_SECONDS
    )

    submitted = time.monotonic()
    quiet_ids = [
        submit(neighbour, scripted_task([{"content": f"hello {n}"}])) for n in range(QUIET_TASKS)
    ]
    done = wait_all(neighbour, None, quiet_ids, timeout=QUIET_WITHIN_SECONDS)
    took = time.monotonic() - submitted
    assert {task["status"] for task in done.values()} == {"succeeded"}, done
    assert took < QUIET_WITHIN_SECONDS, took

    # The bombs' tasks ended too: each call failed, and the model read why as its result.
    for task_id, task in wait_all(attacker, None, bombs, timeout=QUIET_WITHIN_SECONDS).items():
        assert task["status"] == "succeeded", task
        assert task["result"]["output"].startswith("error: cannot evaluate"), task
        assert "10,000 bits" in task["result"]["output"], task
        (step, *_) = attacker.get(f"/v1/tasks/{task_id}/steps").json()["items"]
        assert [call["status"] for call in step["tool_calls"]] == ["failed"], step
