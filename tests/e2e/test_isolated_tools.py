"""Isolated tools (``@tool(isolation="process")``) on a real worker: killed, never abandoned.

A tool that overruns its limit in a tool process is killed there, so the side effect it
would have had after the limit never lands; the same tool on a thread is abandoned and lands
it anyway (shown side by side, so the receiver is known to hear such calls). And a tool that
breaks its process in any way a tool can fails only its own call: the worker process, and the
dozens of other steps it runs meanwhile, carry on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx

from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory, child_pids
from tests.e2e.util import wait_all
from tests.fakes.receiver import WebhookReceiver
from tests.helpers import scripted_task, tool_turn

LATE_HOOK_LIMIT_SECONDS = 1.0  # late_hook's own limit (tests.sample_agents)
LATE_SECONDS = 3.0  # when the late hook calls its receiver: well past its 1 s limit
MARGIN_SECONDS = 3.0  # how much longer the test listens for a call that must never come
NEIGHBOURS = 40
NEIGHBOUR_SLEEP_SECONDS = 10.0


def submit(http: httpx.Client, body: dict[str, Any]) -> str:
    response = http.post("/v1/tasks", json=body)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def isolated_task(tool: str, **arguments: Any) -> dict[str, Any]:
    return scripted_task([tool_turn(tool, **arguments)], agent="isolated", tools=[tool])


def the_call(http: httpx.Client, task_id: str) -> dict[str, Any]:
    (step, *_) = http.get(f"/v1/tasks/{task_id}/steps").json()["items"]
    (call,) = step["tool_calls"]
    return dict(call)


def wait_until(check: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not {what} after {timeout:g} s"
        time.sleep(0.1)


def test_a_tool_past_its_limit_is_killed_and_its_late_side_effect_never_lands(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    fleet = stack(workers=1, concurrency=1)
    with WebhookReceiver() as receiver, fleet.client(tenant.headers) as http:
        killed = submit(
            http, isolated_task("late_hook", url=receiver.url("/process"), seconds=LATE_SECONDS)
        )
        abandoned = submit(
            http,
            isolated_task("late_hook_in_thread", url=receiver.url("/thread"), seconds=LATE_SECONDS),
        )
        tasks = wait_all(http, None, [killed, abandoned], timeout=120)
        # The abandoned thread calls its receiver once it wakes: such a call is heard ...
        receiver.wait_for(1, path="/thread", timeout=60)
        # ... and the killed process's call, due at the same time, never comes.
        time.sleep(MARGIN_SECONDS)
        assert receiver.received("/process") == []
        call = the_call(http, killed)

    # The model was told the call failed, and why; the task went on to its answer.
    assert tasks[killed]["status"] == "succeeded", tasks[killed]
    told = tasks[killed]["result"]["output"]
    assert told.startswith("error:"), told
    assert f"timed out after {LATE_HOOK_LIMIT_SECONDS:g} s: its tool process was killed" in told
    assert "may still complete" not in told  # a killed call completes nothing
    assert call["status"] == "failed", call
    # The thread's call was told the same, yet its side effect landed after it.
    assert tasks[abandoned]["result"]["output"].startswith("error:"), tasks[abandoned]


def test_a_cancel_kills_the_tool_process_of_the_call_in_flight(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    # ``sleep`` says nothing of where it runs: the setting sends it to a tool process.
    fleet = stack(workers=1, concurrency=1, env={"RATCHET_TOOL_ISOLATION": "process"})
    [worker] = fleet.worker_child_pids(0)
    with fleet.client(tenant.headers) as http:
        task_id = submit(http, scripted_task([tool_turn("sleep", seconds=600)], tools=["sleep"]))
        wait_until(lambda: bool(the_steps(http, task_id)), timeout=60, what="the call started")
        wait_until(lambda: bool(child_pids(worker)), timeout=60, what="its tool process up")
        [tool_process] = child_pids(worker)
        assert http.post(f"/v1/tasks/{task_id}/cancel").status_code == 202
        [task] = wait_all(http, None, [task_id], timeout=60).values()
        call = the_call(http, task_id)
    assert task["status"] == "cancelled", task
    assert call["status"] == "failed", call
    # Killed, not left sleeping: the worker process has no child left.
    wait_until(lambda: tool_process not in child_pids(worker), timeout=30, what="killed")
    assert fleet.worker_child_pids(0) == [worker]


HOSTILE = {
    "hog_memory": ({"gigabytes": 4}, "ran out of memory"),
    "fork_bomb": ({}, "started more than 32 processes"),
    "segfault": ({}, "ended its tool process (killed by SIGSEGV)"),
    "exit_abruptly": ({"status": 3}, "ended its tool process (exit status 3)"),
}


def test_tools_that_break_their_process_fail_their_calls_while_the_workers_other_steps_succeed(
    stack: StackFactory, make_tenant: Callable[..., TenantHandle]
) -> None:
    """Each way a tool can break its process (4 GB, a fork bomb, a segfault, ``os._exit``),
    all at once, among dozens of a neighbour's steps in flight on the same worker."""
    attacker, neighbour = make_tenant(), make_tenant()
    fleet = stack(workers=1, concurrency=1)
    [worker] = fleet.worker_child_pids(0)
    quiet = scripted_task(
        [tool_turn("sleep", seconds=NEIGHBOUR_SLEEP_SECONDS), {"content": "done"}],
        tools=["sleep"],
    )
    with fleet.client(neighbour.headers) as others, fleet.client(attacker.headers) as http:
        quiet_ids = [submit(others, quiet) for _ in range(NEIGHBOURS)]
        # Dozens of steps in flight on the worker (each in its sleep) when the tools break.
        wait_until(
            lambda: (
                sum(bool(the_steps(others, task_id)) for task_id in quiet_ids) >= NEIGHBOURS // 2
            ),
            timeout=60,
            what="the neighbours' steps under way",
        )
        hostile_ids = {
            name: submit(http, isolated_task(name, **arguments))
            for name, (arguments, _) in HOSTILE.items()
        }
        tasks = wait_all(http, None, hostile_ids.values(), timeout=120)
        calls = {name: the_call(http, task_id) for name, task_id in hostile_ids.items()}
        neighbours = wait_all(others, None, quiet_ids, timeout=120)
        sleeps = [the_call(others, task_id) for task_id in quiet_ids]

    def in_flight(moment: str) -> int:
        """How many of the neighbours' calls were under way at ``moment`` (the ledger's times)."""
        at = datetime.fromisoformat(moment)
        return sum(
            datetime.fromisoformat(c["started_at"])
            <= at
            <= datetime.fromisoformat(c["finished_at"])
            for c in sleeps
        )

    for name, (_, error) in HOSTILE.items():
        call, task = calls[name], tasks[hostile_ids[name]]
        assert call["status"] == "failed", call
        assert error in call["error"], call
        assert task["status"] == "succeeded", task  # the model was told (tell_model) and answered
        assert task["result"]["output"].startswith("error:"), task
    # They ran when each tool broke its process, and ...
    broke = {name: in_flight(call["finished_at"]) for name, call in calls.items()}
    assert all(n >= NEIGHBOURS // 2 for n in broke.values()), broke
    assert {t["status"] for t in neighbours.values()} == {"succeeded"}, neighbours  # ... all won
    # The same worker process ran them all: it neither crashed nor was replaced.
    assert fleet.worker_child_pids(0) == [worker]


def the_steps(http: httpx.Client, task_id: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = http.get(f"/v1/tasks/{task_id}/steps").json()["items"]
    return items
