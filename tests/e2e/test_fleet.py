"""A fleet: the API and two worker processes on real Postgres and Redis, over HTTP; and the
operator's live view of it (``/v1/admin/fleet``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory
from tests.e2e.util import wait_all
from tests.helpers import scripted_task, tool_turn

TASKS = 100
STEPS = 3


def script(n: int) -> list[dict[str, Any]]:
    """Two calculator steps and a final answer, with numbers of the task's own."""
    return [
        tool_turn("calculator", expression=f"{n}+1"),
        tool_turn("calculator", expression=f"{n}*2"),
        {"content": f"task {n}: {n + 1} and {n * 2}"},
    ]


def check_steps(steps: list[dict[str, Any]], *, task_id: str, n: int) -> None:
    """Every model call and every tool call of task ``n``, in order, each exactly once."""
    assert [s["number"] for s in steps] == [1, 2, 3], steps
    assert all(s["status"] == "completed" for s in steps), steps
    assert all(s["usage"]["input_tokens"] > 0 for s in steps), steps
    expected_calls = [(f"{n}+1", n + 1), (f"{n}*2", n * 2)]
    for step, (expression, value) in zip(steps, expected_calls, strict=False):
        [asked] = step["model"]["tool_calls"]
        assert (asked["name"], asked["arguments"]) == ("calculator", {"expression": expression})
        [call] = step["tool_calls"]
        assert call["name"] == "calculator"
        assert call["arguments"] == {"expression": expression}
        assert call["status"] == "succeeded", call
        assert call["result"] == value
        assert call["error"] is None
        assert call["runs"] == 1
        assert call["idempotency_key"] == f"{task_id}:{step['number']}-0"
        assert call["finished_at"] is not None
    final = steps[2]
    assert final["model"] == {"content": f"task {n}: {n + 1} and {n * 2}", "tool_calls": []}
    assert final["tool_calls"] == []


def test_two_workers_run_a_hundred_tasks_to_the_end(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    fleet = stack(workers=2, concurrency=1)
    with fleet.client(headers=tenant.headers) as http:
        numbers: dict[str, int] = {}
        for n in range(TASKS):
            response = http.post("/v1/tasks", json=scripted_task(script(n), metadata={"n": n}))
            assert response.status_code == 202, response.text
            numbers[response.json()["id"]] = n

        tasks = wait_all(http, None, numbers, timeout=90)

        for task_id, n in numbers.items():
            task = tasks[task_id]
            assert task["status"] == "succeeded", (task, fleet.logs(tail=50))
            assert task["result"] == {"output": f"task {n}: {n + 1} and {n * 2}"}
            assert task["steps"] == STEPS
            assert task["error"] is None
            assert task["metadata"] == {"n": n}
            response = http.get(f"/v1/tasks/{task_id}/steps")
            assert response.status_code == 200, response.text
            check_steps(response.json()["items"], task_id=task_id, n=n)

    started = [fleet.first_steps(i) for i in range(2)]
    # Every task's first step ran on one worker or the other (a message may carry several
    # tasks' steps); its later steps ran where its first did.
    assert started[0] | started[1] == set(numbers), (len(started[0]), len(started[1]))
    # Both workers took a fair share of the tasks, not just a token one.
    assert min(len(s) for s in started) >= TASKS // 10, [len(s) for s in started]


def live_pids(http: httpx.Client, worker_pid: int) -> set[int]:
    """The pids the live view lists for the worker whose main process is ``worker_pid``."""
    response = http.get("/v1/admin/fleet")
    assert response.status_code == 200, response.text
    return {w["pid"] for w in response.json()["workers"] if w["worker_pid"] == worker_pid}


def wait_until(check: Callable[[], bool], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_live_view_lists_each_worker_process_until_it_dies(
    stack: StackFactory, make_tenant: Callable[..., TenantHandle]
) -> None:
    operator = make_tenant(("operator",))
    fleet = stack(workers=1, concurrency=2, env={"RATCHET_PRESENCE_INTERVAL_SECONDS": "0.5"})
    worker = fleet.worker_procs[0]
    children = set(fleet.worker_child_pids(0))
    with fleet.client(headers=operator.headers) as http:
        # The prefork children run the steps: each of them is listed, under its worker.
        assert wait_until(lambda: live_pids(http, worker.pid) == children), fleet.logs(tail=50)
        first, _ = http.get("/v1/admin/fleet").json()["workers"]
        assert first["name"].startswith(f"{fleet.worker_names[0]}@")
        assert (first["pool"], first["concurrency"], first["busy"]) == ("prefork", 2, 0)

        fleet.kill_worker(0)  # its whole process group, with no goodbye: the records run out
        assert wait_until(lambda: live_pids(http, worker.pid) == set(), timeout=5)
