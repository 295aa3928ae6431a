"""Sub-agents against real processes: a parent fans out to three researchers in one turn,
each of which takes two tool-calling steps, and answers with their results; a worker killed
with SIGKILL at each point of a sub-agent call never makes a second child for one call and
never loses a child's result."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import TenantHandle
from tests.e2e.conftest import FAST_RECOVERY, StackFactory
from tests.e2e.util import wait_all
from tests.helpers import scripted_task

# Killed workers leave unacked messages behind.
pytestmark = pytest.mark.usefixtures("forget_unacked")

RESULT = "researched: 42 and 1024"


def fan_out(agent: str = "researcher", n: int = 3) -> dict[str, Any]:
    calls = [{"name": agent, "arguments": {"task": f"question {i}"}} for i in range(n)]
    return scripted_task([{"tool_calls": calls}, {"content": "the team answered"}], agent="lead")


def children(http: httpx.Client, task_id: str) -> list[dict[str, Any]]:
    answer = http.get(f"/v1/tasks/{task_id}/children")
    assert answer.status_code == 200, answer.text
    return list(answer.json()["items"])


def check_family(http: httpx.Client, parent: dict[str, Any], *, result: str = RESULT) -> None:
    """The parent got each child's result, each call started one child, usage rolled up."""
    assert parent["status"] == "succeeded", parent
    kids = children(http, parent["id"])
    assert len(kids) == 3, kids  # one child per call, never a second
    assert sorted(k["status"] for k in kids) == ["succeeded"] * 3
    (step, _) = http.get(f"/v1/tasks/{parent['id']}/steps").json()["items"]
    calls = step["tool_calls"]
    assert [c["result"] for c in calls] == [result] * 3
    assert sorted(c["wait"]["child_id"] for c in calls) == sorted(k["id"] for k in kids)
    for field in ("input_tokens", "output_tokens"):
        assert parent["children_usage"][field] == sum(k["usage"][field] for k in kids)


def test_a_parent_fans_out_to_three_sub_agents_and_answers(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    fleet = stack(workers=2, concurrency=2, env=FAST_RECOVERY)
    with fleet.client(headers=tenant.headers) as http:
        parent_id = http.post("/v1/tasks", json=fan_out()).json()["id"]
        (parent,) = wait_all(http, None, [parent_id], timeout=90).values()
        check_family(http, parent)
        for kid in children(http, parent_id):
            # two tool-calling steps and the answer, each once: no step ran twice
            assert (kid["steps"], kid["parent_id"], kid["root_id"]) == (3, parent_id, parent_id)
        events = http.get(f"/v1/tasks/{parent_id}/events").text
    assert events.count("event: wait.settled") == 3  # each child's end, on the parent's stream


KILL_POINTS = [
    "after_model_commit",  # the parent's answer (three sub-agent calls) committed
    "after_child_start",  # a child committed, its call not yet parked
    "after_park",  # the parent parked, what settled meanwhile not yet looked at
    "after_child_end",  # a child's end committed, the parent's wait not yet settled
    "resume_parked",  # the parent resuming, a child's result not yet committed as its call's
]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_at_each_point_of_a_sub_agent_call_loses_nothing_and_starts_no_second_child(
    point: str, stack: StackFactory, tenant: TenantHandle, tmp_path: Path
) -> None:
    marker = tmp_path / "killed"
    env = {**FAST_RECOVERY, "RATCHET_FAILPOINTS": f"{point}=kill_once:{marker}"}
    fleet = stack(workers=2, concurrency=1, env=env)
    with fleet.client(headers=tenant.headers) as http:
        parent_id = http.post("/v1/tasks", json=fan_out()).json()["id"]
        (parent,) = wait_all(http, None, [parent_id], timeout=120).values()
        assert marker.exists(), "no worker reached the failpoint"
        check_family(http, parent)


def test_kill_while_the_children_run(stack: StackFactory, tenant: TenantHandle) -> None:
    fleet = stack(workers=2, concurrency=2, env=FAST_RECOVERY)
    with fleet.client(headers=tenant.headers) as http:
        parent_id = http.post("/v1/tasks", json=fan_out("slow_researcher")).json()["id"]
        deadline = time.monotonic() + 60
        while not any(k["status"] == "running" for k in children(http, parent_id)):
            assert time.monotonic() < deadline, "no child ever ran"
            time.sleep(0.05)
        fleet.kill_worker(0)
        fleet.kill_worker(1)
        fleet.start_worker()
        (parent,) = wait_all(http, None, [parent_id], timeout=120).values()
        check_family(http, parent, result="slowly researched")


def test_cancelling_the_root_cancels_running_grandchildren_within_their_step(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    # The grandchildren's model calls take a minute: only a cancel ends them in time.
    env = {**FAST_RECOVERY, "RATCHET_TEST_SLOW_RESEARCH_MS": "60000"}
    fleet = stack(workers=1, concurrency=4, env=env)
    body = scripted_task(
        [{"tool_calls": [{"name": "manager", "arguments": {"task": "research it"}}]}],
        agent="lead",
    )
    with fleet.client(headers=tenant.headers) as http:
        root = http.post("/v1/tasks", json=body).json()["id"]
        deadline = time.monotonic() + 60
        while True:
            middle = children(http, root)
            below = children(http, middle[0]["id"]) if middle else []
            if len(below) == 2 and all(g["status"] == "running" for g in below):
                break
            assert time.monotonic() < deadline, (middle, below)
            time.sleep(0.05)
        cancelled = http.post(f"/v1/tasks/{root}/cancel")
        assert cancelled.status_code == 202, cancelled.text
        tree = [root, middle[0]["id"], *(g["id"] for g in below)]
        ended = wait_all(http, None, tree, timeout=30)  # far sooner than their minute
    assert {t["status"] for t in ended.values()} == {"cancelled"}, ended
    for grandchild in below:
        assert ended[grandchild["id"]]["steps"] == 0  # stopped in its first step
        assert ended[grandchild["id"]]["root_id"] == root
