"""The task page's family and waits over HTTP (no browser): a task's tree of sub-agent tasks
(children and grandchildren, each linked, with its parent and root), its children's usage,
and its durable waits; a pending wait's form completes it once, with the session's CSRF
token, in the task's tenant only; and the task list filters by ``waiting``, whose tasks a
bulk cancel takes."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shared.store.db import transaction
from shared.store.tables import Task, Wait
from shared.store.tenants import DEFAULT_SCOPES
from tests.conftest import TenantHandle
from tests.helpers import scripted_task, tool_turn
from tests.integration.test_dashboard import login

pytestmark = pytest.mark.backends("postgresql", "sqlite")
QUESTION = "Which region should I deploy to: <eu> or us?"


def admin(make_tenant: Callable[..., TenantHandle]) -> TenantHandle:
    """A tenant whose key submits tasks and logs in to the dashboard."""
    return make_tenant((*DEFAULT_SCOPES, "admin"))


def start(
    client: TestClient, tenant: TenantHandle, script: list[dict[str, Any]], **extra: Any
) -> str:
    body = scripted_task(script, agent=extra.pop("agent", "lead"), **extra)
    answer = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert answer.status_code == 202, answer.text
    return str(answer.json()["id"])


def research(n: int) -> dict[str, Any]:
    calls = [{"name": "researcher", "arguments": {"task": f"question {i}"}} for i in range(n)]
    return {"tool_calls": calls}


def children_of(client: TestClient, tenant: TenantHandle, task_id: str) -> list[str]:
    answer = client.get(f"/v1/tasks/{task_id}/children", headers=tenant.headers)
    assert answer.status_code == 200, answer.text
    return [child["id"] for child in answer.json()["items"]]


def tree_rows(html: str) -> list[tuple[str, int]]:
    """The task page's family tree: (task id, depth), in the order shown."""
    found = re.findall(r'<tr data-child="([^"]+)" data-depth="(\d+)">', html)
    return [(task_id, int(depth)) for task_id, depth in found]


def three_generations(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> tuple[str, str, list[str], str]:
    """A root lead whose first call starts a lead (which starts two researchers) and whose
    second starts a researcher; every task driven to its end. (root, child lead,
    grandchildren, second child)."""
    nested = {
        "tool_calls": [
            {"name": "lead", "arguments": {"task": "delegate again"}},
            {"name": "researcher", "arguments": {"task": "look it up"}},
        ]
    }
    root = start(client, tenant, [nested, {"content": "done"}])
    assert drive(root) == "waiting"
    lead, second = children_of(client, tenant, root)
    with transaction() as session:  # the child lead's script is its agent's (none): give one
        row = session.get(Task, lead)
        assert row is not None
        row.model, row.model_options = "scripted", {"script": [research(2), {"content": "ok"}]}
    assert drive(lead) == "waiting"
    grandchildren = children_of(client, tenant, lead)
    for task_id in [*grandchildren, second]:
        assert drive(task_id) == "succeeded"
    assert drive(lead) == "succeeded"
    assert drive(root) == "succeeded"
    return root, lead, grandchildren, second


def test_the_task_page_shows_the_tree_below_it_and_links_its_parent_and_root(
    client: TestClient, make_tenant: Callable[..., TenantHandle], drive: Callable[..., str]
) -> None:
    tenant = admin(make_tenant)
    root, lead, grandchildren, second = three_generations(client, tenant, drive)
    login(client, tenant.key)

    page = client.get(f"/dashboard/tasks/{root}").text
    assert tree_rows(page) == [
        (lead, 1),
        *((g, 2) for g in grandchildren),
        (second, 1),
    ]
    for task_id in (lead, *grandchildren, second):
        assert f'href="/dashboard/tasks/{task_id}"' in page
    assert 'id="children-usage"' in page  # its settled children used tokens
    assert 'id="family-parent"' not in page  # a root has no parent

    grandchild = client.get(f"/dashboard/tasks/{grandchildren[0]}").text
    parent = re.search(r'id="family-parent"><a href="/dashboard/tasks/([^"]+)"', grandchild)
    top = re.search(r'id="family-root"><a href="/dashboard/tasks/([^"]+)"', grandchild)
    assert parent is not None
    assert parent.group(1) == lead
    assert top is not None
    assert top.group(1) == root
    # A child's root is its parent: named once, as its parent.
    child = client.get(f"/dashboard/tasks/{second}").text
    assert 'id="family-parent"' in child
    assert 'id="family-root"' not in child
    # Each settled sub-agent call's wait is shown with its child.
    assert child.count('class="pending wait"') == 0
    assert page.count('class="pending wait"') == 2
    assert 'data-status="completed"' in page


def waiting_on_a_question(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> tuple[str, str]:
    ask = tool_turn("ask_user", question=QUESTION)
    task_id = start(client, tenant, [ask, {"content": "deploying"}], agent="default")
    assert drive(task_id) == "waiting"
    with transaction() as session:
        token = session.query(Wait.token).filter_by(task_id=task_id).scalar()
    return task_id, str(token)


def test_a_pending_waits_form_completes_it_once_and_the_task_runs_on(
    client: TestClient, make_tenant: Callable[..., TenantHandle], drive: Callable[..., str]
) -> None:
    tenant = admin(make_tenant)
    task_id, token = waiting_on_a_question(client, tenant, drive)
    csrf = login(client, tenant.key)
    page = client.get(f"/dashboard/tasks/{task_id}").text
    assert "Which region should I deploy to: &lt;eu&gt; or us?" in page  # text, not markup
    assert f'action="/dashboard/tasks/{task_id}/waits/{token}"' in page
    assert "tell_model" in page

    form = {"csrf_token": csrf, "result": "eu-west-1", "format": "text"}
    done = client.post(f"/dashboard/tasks/{task_id}/waits/{token}", data=form)
    assert done.status_code == 200
    assert "Completed the wait of call" in done.text
    with transaction() as session:
        wait = session.get(Wait, token)
        assert wait is not None
        assert (wait.status, wait.payload) == ("completed", "eu-west-1")
        assert wait.settled_by is not None
        assert wait.settled_by.endswith("(dashboard)")
        wait_by = wait.settled_by
        assert session.get(Task, task_id).status == "running"  # type: ignore[union-attr]

    again = client.post(f"/dashboard/tasks/{task_id}/waits/{token}", data=form | {"result": "x"})
    assert "Not completed" in again.text
    assert "already settled" in again.text
    assert drive(task_id) == "succeeded"
    steps = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()["items"]
    assert steps[0]["tool_calls"][0]["result"] == "eu-west-1"  # the first answer, once
    # Its event tells the wait as settled: by whom, with what.
    events = client.get(f"/v1/tasks/{task_id}/events", headers=tenant.headers).text
    [settled] = [
        json.loads(block.split("data: ", 1)[1])
        for block in events.split("\n\n")
        if "event: wait.settled" in block
    ]
    assert (settled["status"], settled["settled_by"]) == ("completed", wait_by)


def test_a_waits_form_refuses_bad_json_a_missing_token_and_another_tenant(
    client: TestClient, make_tenant: Callable[..., TenantHandle], drive: Callable[..., str]
) -> None:
    tenant, other = admin(make_tenant), admin(make_tenant)
    task_id, token = waiting_on_a_question(client, tenant, drive)
    path = f"/dashboard/tasks/{task_id}/waits/{token}"

    csrf = login(client, other.key)
    answer = client.post(path, data={"csrf_token": csrf, "result": "eu", "format": "text"})
    assert answer.status_code == 404  # another tenant's task: not found, not forbidden

    client.cookies.clear()
    csrf = login(client, tenant.key)
    assert client.post(path, data={"result": "eu", "format": "text"}).status_code == 403
    bad = client.post(path, data={"csrf_token": csrf, "result": "{eu", "format": "json"})
    assert "Not completed" in bad.text
    assert "not JSON" in bad.text
    elsewhere = client.post(
        f"/dashboard/tasks/{task_id}/waits/wt_nope", data={"csrf_token": csrf, "result": "eu"}
    )
    assert elsewhere.status_code == 404
    with transaction() as session:
        assert session.get(Wait, token).status == "pending"  # type: ignore[union-attr]

    as_json = {"csrf_token": csrf, "result": '{"region": "eu"}', "format": "json"}
    assert "Completed the wait" in client.post(path, data=as_json).text
    with transaction() as session:
        assert session.get(Wait, token).payload == {"region": "eu"}  # type: ignore[union-attr]


def test_the_task_list_filters_by_waiting_and_a_bulk_cancel_takes_waiting_tasks(
    client: TestClient, make_tenant: Callable[..., TenantHandle], drive: Callable[..., str]
) -> None:
    tenant = admin(make_tenant)
    task_id, token = waiting_on_a_question(client, tenant, drive)
    csrf = login(client, tenant.key)
    listed = client.get("/dashboard/tasks?status=waiting").text
    assert '<option value="waiting" selected>' in listed
    assert f'data-task="{task_id}"' in listed
    assert f'data-task="{task_id}"' not in client.get("/dashboard/tasks?status=running").text

    form = {"csrf_token": csrf, "action": "cancel:matching", "status": "waiting"}
    done = client.post("/dashboard/tasks/bulk", data=form | {"confirmed": "yes"})
    assert "Cancelled 1 task(s)" in done.text
    with transaction() as session:
        assert session.get(Task, task_id).status == "cancelled"  # type: ignore[union-attr]
        assert session.get(Wait, token).status == "cancelled"  # type: ignore[union-attr]
