"""Hung model and tool calls never wedge a worker process for the other tenants.

A bounded worker (one process, 8 step threads). A hostile tenant's tasks call ``http_request``
on a loopback server that sends a byte every 0.2 s for ever: each exchange ends at the tool's
limit (a deadline on the whole exchange, not each read), so the process's calls never pile
up, and another tenant's one-step tasks all finish promptly. And a process whose abandoned
calls (``sleep`` calls that overran their limit and still run) reach
``RATCHET_WORKER_MAX_ABANDONED_CALLS`` is replaced by a fresh one, which goes on with the work.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx

from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory
from tests.e2e.util import wait_all
from tests.fakes.drip_server import DripServer
from tests.helpers import scripted_task, tool_turn

BOUNDED_WORKER = {
    "RATCHET_WORKER_THREADS": "8",
    "RATCHET_TOOL_TIMEOUT_SECONDS": "2",
    "RATCHET_HTTP_ALLOWED_HOSTS": "127.0.0.1",
}
HOSTILE_TASKS = 20
QUIET_TASKS = 5
QUIET_BOUND_SECONDS = 30.0  # each quiet task, submission to finish (a wedged worker: never)


def submit(http: httpx.Client, tenant: TenantHandle, body: dict[str, Any]) -> str:
    response = http.post("/v1/tasks", json=body, headers=tenant.headers)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def took(task: dict[str, Any]) -> float:
    """Seconds from a task's submission to its end."""
    created = datetime.fromisoformat(task["created_at"])
    return (datetime.fromisoformat(task["finished_at"]) - created).total_seconds()


def wait_until(check: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not {what} after {timeout:g} s"
        time.sleep(0.1)


def test_tools_that_drip_never_hold_up_another_tenants_tasks(
    stack: StackFactory, make_tenant: Callable[..., TenantHandle]
) -> None:
    fleet = stack(workers=1, concurrency=1, env=BOUNDED_WORKER)
    hostile, quiet = make_tenant(), make_tenant()
    with DripServer(interval=0.2) as drip, fleet.client() as http:
        call = tool_turn("http_request", url=drip.url("/drip-body"))
        hostile_ids = [
            submit(http, hostile, scripted_task([call, call], tools=["http_request"]))
            for _ in range(HOSTILE_TASKS)
        ]
        # More drips under way than the step threads: the worker is as busy as it gets.
        wait_until(lambda: len(drip.requests) >= 8, timeout=60, what="dripping")
        quiet_ids = [
            submit(http, quiet, scripted_task([{"content": "done"}])) for _ in range(QUIET_TASKS)
        ]
        quiet_tasks = wait_all(http, quiet.headers, quiet_ids, timeout=120)
        hostile_tasks = wait_all(http, hostile.headers, hostile_ids, timeout=180)
    assert {t["status"] for t in quiet_tasks.values()} == {"succeeded"}
    slowest = max(took(task) for task in quiet_tasks.values())
    assert slowest < QUIET_BOUND_SECONDS, f"a quiet task took {slowest:.1f} s"
    # Nothing lost on the hostile side either: each call failed at its limit, the model was
    # told, and every task went on to its end.
    assert {t["status"] for t in hostile_tasks.values()} == {"succeeded"}


def test_a_process_with_too_many_abandoned_calls_is_replaced_and_the_work_goes_on(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    env = {
        **BOUNDED_WORKER,
        "RATCHET_TOOL_TIMEOUT_SECONDS": "1",
        "RATCHET_WORKER_MAX_ABANDONED_CALLS": "3",
        "RATCHET_SHUTDOWN_GRACE_SECONDS": "5",
    }
    fleet = stack(workers=1, concurrency=1, env=env)
    [child] = fleet.worker_child_pids(0)
    with fleet.client(headers=tenant.headers) as http:
        # Each sleep overruns its 1 s limit and goes on sleeping: an abandoned call.
        hung = scripted_task([tool_turn("sleep", seconds=600)], tools=["sleep"])
        hung_ids = [submit(http, tenant, hung) for _ in range(3)]
        wait_until(lambda: child not in fleet.worker_child_pids(0), timeout=60, what="replaced")
        assert "recycling worker process" in fleet.log_text("worker-0")
        wait_until(lambda: len(fleet.worker_child_pids(0)) == 1, timeout=60, what="restarted")
        later = submit(http, tenant, scripted_task([{"content": "done"}]))
        tasks = wait_all(http, None, [*hung_ids, later], timeout=120)
    assert {t["status"] for t in tasks.values()} == {"succeeded"}
    assert fleet.worker_child_pids(0) != [child]
