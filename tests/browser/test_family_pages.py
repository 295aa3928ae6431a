"""A task's family and its durable waits on the task page, in a real browser against a real
API and worker: a parent's page shows its three sub-agent tasks as a tree, each linked, and
a child's page links back to its parent; a task waiting on ``ask_user`` shows the question,
and answering it in the page's form completes the wait, once, and the task runs on with the
answer as the call's result."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.browser.conftest import TenantFactory
from tests.conftest import TenantHandle
from tests.e2e.conftest import Stack
from tests.e2e.util import wait_all
from tests.helpers import scripted_task, tool_turn

THREE = {
    "tool_calls": [{"name": "researcher", "arguments": {"task": f"question {i}"}} for i in range(3)]
}
QUESTION = "Deploy to <b>staging</b> or production?"


@pytest.fixture(scope="module")
def tenant(make_tenant: TenantFactory) -> TenantHandle:
    from shared.store.tenants import DEFAULT_SCOPES

    return make_tenant(scopes=(*DEFAULT_SCOPES, "admin"))  # its key submits and logs in


@pytest.fixture
def http(stack: Stack, tenant: TenantHandle) -> Iterator[httpx.Client]:
    with stack.client(tenant.headers) as client:
        yield client


def submit(http: httpx.Client, body: dict[str, Any]) -> str:
    response = http.post("/v1/tasks", json=body)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def waiting(http: httpx.Client, task_id: str, timeout: float = 60.0) -> dict[str, Any]:
    """The task once it is parked on its waits."""
    deadline = time.monotonic() + timeout
    while (task := http.get(f"/v1/tasks/{task_id}").json())["status"] != "waiting":
        assert task["status"] not in ("succeeded", "failed", "cancelled"), task
        assert time.monotonic() < deadline, f"task {task_id} not waiting after {timeout} s"
        time.sleep(0.1)
    return dict(task)


def test_a_parents_page_shows_its_three_children_as_a_tree_each_linked(
    login: Any, tenant: TenantHandle, http: httpx.Client
) -> None:
    parent = submit(http, scripted_task([THREE, {"content": "all three answered"}], agent="lead"))
    assert wait_all(http, None, [parent])[parent]["status"] == "succeeded"
    kids = [k["id"] for k in http.get(f"/v1/tasks/{parent}/children").json()["items"]]
    assert len(kids) == 3

    page: Page = login(tenant.key)
    page.goto(f"/dashboard/tasks/{parent}")
    rows = page.locator("table.tree tbody tr")
    expect(rows).to_have_count(3)
    assert rows.evaluate_all("rows => rows.map(r => r.dataset.child)") == kids
    for row in rows.all():
        expect(row.locator(".state")).to_have_text("succeeded")
        expect(row).to_contain_text("researcher")
        expect(row).to_contain_text(" in / ")
    expect(page.locator("#children-usage")).to_contain_text(" in / ")

    rows.nth(1).get_by_role("link").click()
    expect(page).to_have_url(f"{page.url.split('/dashboard')[0]}/dashboard/tasks/{kids[1]}")
    expect(page.locator("#task-state")).to_have_text("succeeded")
    expect(page.locator("table.tree")).to_have_count(0)  # it started none
    page.locator("#family-parent").get_by_role("link", name=parent).click()
    expect(page.locator("table.tree tbody tr")).to_have_count(3)


def test_answering_an_ask_user_question_in_the_page_completes_the_wait_once(
    login: Any, tenant: TenantHandle, http: httpx.Client
) -> None:
    ask = tool_turn("ask_user", question=QUESTION)
    task_id = submit(http, scripted_task([ask, {"content": "deploying"}], agent="default"))
    [wait] = waiting(http, task_id)["waiting"]["waits"]

    page: Page = login(tenant.key)
    page.goto(f"/dashboard/tasks/{task_id}")
    expect(page.locator("#task-state")).to_have_text("waiting")
    pending = page.locator(f"[data-wait='{wait['token']}']")
    expect(pending.locator("blockquote.question")).to_have_text(QUESTION)  # text, not markup
    expect(pending).to_contain_text("tell_model")
    pending.get_by_label("Answer").fill("staging, please")
    pending.get_by_role("button", name="Complete the wait").click()

    expect(page.get_by_text("Completed the wait of call")).to_be_visible()
    done = wait_all(http, None, [task_id])[task_id]
    assert done["status"] == "succeeded"
    settled = http.get(f"/v1/waits/{wait['token']}").json()
    assert (settled["status"], settled["result"]) == ("completed", "staging, please")
    assert settled["settled_by"].endswith("(dashboard)")
    [call] = http.get(f"/v1/tasks/{task_id}/steps").json()["items"][0]["tool_calls"]
    assert call["result"] == "staging, please"
    # Once settled, the page shows the answer and no form.
    expect(page.locator("#task-state")).to_have_text("succeeded")
    expect(pending.locator("form")).to_have_count(0)
    expect(pending).to_contain_text("staging, please")
