"""Sub-agents: a parent's sub-agent calls start one child task each, exactly once per call;
the parent waits holding nothing and resumes with each child's answer (or its failure) as
the call's result; usage rolls up; a cancel takes the whole tree; the root's budget bounds
the tree; the depth limit is a tool error the model reads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shared.store.db import transaction
from shared.store.tables import Task, Wait
from tests.conftest import TenantHandle
from tests.helpers import scripted_task

pytestmark = pytest.mark.backends("postgresql", "sqlite")


def research(n: int) -> dict[str, Any]:
    return {
        "tool_calls": [
            {"name": "researcher", "arguments": {"task": f"question {i}"}} for i in range(n)
        ]
    }


def start(
    client: TestClient, tenant: TenantHandle, script: list[dict[str, Any]], **extra: Any
) -> str:
    body = scripted_task(script, agent="lead", **extra)
    answer = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert answer.status_code == 202, answer.text
    return str(answer.json()["id"])


def children_of(client: TestClient, tenant: TenantHandle, task_id: str) -> list[dict[str, Any]]:
    answer = client.get(f"/v1/tasks/{task_id}/children", headers=tenant.headers)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["items"])


def test_a_parent_fans_out_to_three_sub_agents_and_answers_with_their_results(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    parent = start(client, tenant, [research(3), {"content": "all three answered"}])
    assert drive(parent) == "waiting"
    task = client.get(f"/v1/tasks/{parent}", headers=tenant.headers).json()
    assert [w["kind"] for w in task["waiting"]["waits"]] == ["child"] * 3
    kids = children_of(client, tenant, parent)
    assert len(kids) == 3
    assert {k["parent_id"] for k in kids} == {parent}
    assert {k["root_id"] for k in kids} == {parent}
    for kid in kids:
        assert drive(kid["id"]) == "succeeded"
    assert drive(parent) == "succeeded"
    steps = client.get(f"/v1/tasks/{parent}/steps", headers=tenant.headers).json()["items"]
    results = [c["result"] for c in steps[0]["tool_calls"]]
    assert results == ["researched: 42 and 1024"] * 3
    assert {c["wait"]["status"] for c in steps[0]["tool_calls"]} == {"completed"}
    with transaction() as session:
        assert session.query(Task).filter_by(parent_id=parent).count() == 3  # each ran once
    done = client.get(f"/v1/tasks/{parent}", headers=tenant.headers).json()
    kids = children_of(client, tenant, parent)
    for field in ("input_tokens", "output_tokens"):
        spent = sum(k["usage"][field] for k in kids)
        assert done["children_usage"][field] == spent
        assert done["usage"][field] > spent  # its own calls' too
    events = client.get(f"/v1/tasks/{parent}/events", headers=tenant.headers).text
    assert events.count("event: wait.settled") == 3
    assert "event: task.waiting" in events


def test_a_child_failure_is_a_tool_error_the_parent_model_reads(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    parent = start(client, tenant, [research(1), {"content": "done"}])
    assert drive(parent) == "waiting"
    (kid,) = children_of(client, tenant, parent)
    answer = client.post(f"/v1/tasks/{kid['id']}/cancel", headers=tenant.headers)
    assert answer.status_code == 202, answer.text
    from shared.actions import waits
    from shared.store.db import get_sessionmaker

    # A cancel outside a worker: the sweeper's backstop settles the parent's wait.
    with get_sessionmaker()() as session:
        waits.settle_child(session, kid["id"])
    assert drive(parent) == "succeeded"
    (call,) = client.get(f"/v1/tasks/{parent}/steps", headers=tenant.headers).json()["items"][0][
        "tool_calls"
    ]
    assert call["status"] == "failed"
    assert "cancelled" in call["error"]


def test_the_same_call_never_starts_a_second_child(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    from shared.actions import families
    from shared.store.db import get_sessionmaker

    parent = start(client, tenant, [research(1), {"content": "done"}])
    assert drive(parent) == "waiting"
    with transaction() as session:
        row = session.get(Task, parent)
        assert row is not None
        session.expunge(row)
    (kid,) = children_of(client, tenant, parent)
    for _ in range(3):  # as a re-run after a crash between the start and the park would
        with get_sessionmaker()() as session:
            again, _ = families.start_child(
                session, row, call_id="1-0", agent="researcher", task="question 0"
            )
        assert again == kid["id"]
    with transaction() as session:
        assert session.query(Task).filter_by(parent_id=parent).count() == 1


def test_cancelling_the_root_cancels_the_whole_tree(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    # lead → lead (a sub-agent of itself) → researcher: a root, a child and a grandchild.
    nested = {"tool_calls": [{"name": "lead", "arguments": {"task": "delegate again"}}]}
    root = start(client, tenant, [nested, {"content": "done"}])
    assert drive(root) == "waiting"
    (child,) = children_of(client, tenant, root)
    # The child is a lead too; its script is its agent's (none): give it one through the DB.
    with transaction() as session:
        row = session.get(Task, child["id"])
        assert row is not None
        row.model, row.model_options = "scripted", {"script": [research(2)]}
    assert drive(child["id"]) == "waiting"
    grandchildren = children_of(client, tenant, child["id"])
    assert len(grandchildren) == 2
    assert {g["root_id"] for g in grandchildren} == {root}
    answer = client.post(f"/v1/tasks/{root}/cancel", headers=tenant.headers)
    assert answer.status_code == 202, answer.text
    with transaction() as session:
        tree = [root, child["id"], *(g["id"] for g in grandchildren)]
        statuses = {t: session.get(Task, t).status for t in tree}  # type: ignore[union-attr]
        pending = session.query(Wait).filter(Wait.status == "pending").count()
    assert set(statuses.values()) == {"cancelled"}, statuses
    assert pending == 0


def test_the_roots_budget_stops_a_tree_whose_children_together_exceed_it(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    # Each researcher uses 110 tokens; three of them exceed the root's 250.
    parent = start(
        client,
        tenant,
        [research(3), {"content": "over budget"}],
        budget={"max_tokens": 250},
    )
    assert drive(parent) == "waiting"
    kids = children_of(client, tenant, parent)
    assert all(k["status"] == "queued" for k in kids)
    for kid in kids:
        drive(kid["id"])
    assert drive(parent) == "failed"
    task = client.get(f"/v1/tasks/{parent}", headers=tenant.headers).json()
    assert task["error"]["type"] == "budget_exceeded", task["error"]
    assert task["usage"]["input_tokens"] + task["usage"]["output_tokens"] > 250


def test_past_the_depth_limit_a_sub_agent_call_is_a_tool_error(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], configure: Any
) -> None:
    configure(RATCHET_SUBAGENT_MAX_DEPTH="1")
    nested = {"tool_calls": [{"name": "lead", "arguments": {"task": "delegate again"}}]}
    root = start(client, tenant, [nested, {"content": "done"}])
    assert drive(root) == "waiting"
    (child,) = children_of(client, tenant, root)
    with transaction() as session:
        row = session.get(Task, child["id"])
        assert row is not None
        row.model, row.model_options = "scripted", {"script": [research(1), {"content": "x"}]}
    assert drive(child["id"]) == "succeeded"
    steps = client.get(f"/v1/tasks/{child['id']}/steps", headers=tenant.headers).json()["items"]
    (call,) = steps[0]["tool_calls"]
    assert call["status"] == "failed"
    assert "RATCHET_SUBAGENT_MAX_DEPTH" in call["error"]
    assert children_of(client, tenant, child["id"]) == []
    assert drive(root) == "succeeded"
