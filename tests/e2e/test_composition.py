"""Composition against real processes, the parts not shown elsewhere: a batch of 1,000
one-step tasks accepted in one request and all run, its replay creating nothing; a root's
budget stopping a tree whose children together exceed it; an expired wait following its
policy through the sweeper of a real worker."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from shared.store.db import transaction
from shared.store.tables import Task
from tests.conftest import TenantHandle
from tests.e2e.conftest import FAST_RECOVERY, StackFactory
from tests.e2e.util import wait_all
from tests.helpers import scripted_task, tool_turn

# A stopped worker leaves the messages it held unacked behind.
pytestmark = pytest.mark.usefixtures("forget_unacked")


def test_a_batch_of_a_thousand_is_accepted_at_once_all_run_and_a_replay_makes_nothing(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    fleet = stack(workers=1, concurrency=2, env=FAST_RECOVERY)
    tasks = [scripted_task([{"content": f"answer {n}"}], input=f"task {n}") for n in range(1000)]
    headers = {"Idempotency-Key": "nightly-2026-11-28"}
    with fleet.client(headers=tenant.headers) as http:
        first = http.post("/v1/tasks/batch", json={"tasks": tasks}, headers=headers, timeout=120)
        assert first.status_code == 202, first.text
        batch = first.json()
        ids = [item["task_id"] for item in batch["items"]]
        assert len(set(ids)) == 1000
        again = http.post("/v1/tasks/batch", json={"tasks": tasks}, headers=headers, timeout=120)
        assert again.status_code in (200, 202), again.text
        assert again.json()["batch_id"] == batch["batch_id"]
        done = http.get(f"/v1/batches/{batch['batch_id']}", params={"wait": 60}, timeout=90)
        assert done.status_code == 200, done.text
        finished = wait_all(http, None, ids, timeout=300)
    assert {t["status"] for t in finished.values()} == {"succeeded"}
    with transaction() as session:
        made = session.scalar(
            select(func.count()).select_from(Task).where(Task.tenant_id == tenant.id)
        )
    assert made == 1000  # the replay created nothing


def test_the_roots_budget_stops_a_tree_whose_children_together_exceed_it(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    fleet = stack(workers=1, concurrency=4, env=FAST_RECOVERY)
    calls = [{"name": "researcher", "arguments": {"task": f"q{i}"}} for i in range(3)]
    body = scripted_task(
        [{"tool_calls": calls}, {"content": "never said"}],
        agent="lead",
        budget={"max_tokens": 250},
    )
    with fleet.client(headers=tenant.headers) as http:
        root_id = http.post("/v1/tasks", json=body).json()["id"]
        (root,) = wait_all(http, None, [root_id], timeout=90).values()
        kids = http.get(f"/v1/tasks/{root_id}/children").json()["items"]
    assert root["status"] == "failed", root
    assert root["error"]["type"] == "budget_exceeded", root["error"]
    assert len(kids) == 3
    spent = sum(k["usage"]["input_tokens"] + k["usage"]["output_tokens"] for k in kids)
    assert root["children_usage"]["input_tokens"] + root["children_usage"]["output_tokens"] == spent
    assert root["usage"]["input_tokens"] + root["usage"]["output_tokens"] > 250  # the tree's
    assert all(k["status"] in ("succeeded", "failed") for k in kids)  # each settled, none left


def test_an_expired_wait_tells_the_model_through_a_real_sweeper(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    env = {**FAST_RECOVERY, "RATCHET_TEST_WAIT_S": "1", "RATCHET_TEST_WAIT_POLICY": "tell_model"}
    fleet = stack(workers=1, concurrency=2, env=env)
    body = scripted_task([tool_turn("await_ci", run="b"), {"content": "no CI"}], agent="lead")
    with fleet.client(headers=tenant.headers) as http:
        task_id = http.post("/v1/tasks", json=body).json()["id"]
        (task,) = wait_all(http, None, [task_id], timeout=60).values()
        (step, _) = http.get(f"/v1/tasks/{task_id}/steps").json()["items"]
    assert task["status"] == "succeeded", task
    (call,) = step["tool_calls"]
    assert call["result"]["timed_out"] is True
    assert call["wait"]["status"] == "expired"
