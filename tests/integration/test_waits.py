"""Durable waits: a tool parks its task on the outside world; the task waits holding nothing
until ``POST /v1/waits/{token}`` (a key, or the wait's signed URL) completes it, once — the
body is the call's result and a second completion is a 409 — or its deadline applies its
policy; a cancel settles it; ``ask_user`` asks the person a question the same way."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient

from shared.store.db import transaction
from shared.store.tables import Task, Wait
from tests.conftest import Configure, TenantHandle
from tests.helpers import scripted_task, tool_turn
from tests.integration.test_api import assert_problem

pytestmark = pytest.mark.backends("postgresql", "sqlite")
CI = tool_turn("await_ci", run="build-7")


def start(
    client: TestClient, tenant: TenantHandle, script: list[dict[str, Any]], **extra: Any
) -> str:
    body = scripted_task(script, agent=extra.pop("agent", "lead"), **extra)
    answer = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert answer.status_code == 202, answer.text
    return str(answer.json()["id"])


def the_wait(client: TestClient, tenant: TenantHandle, task_id: str) -> dict[str, Any]:
    task = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    assert task["status"] == "waiting", task
    (wait,) = task["waiting"]["waits"]
    return dict(wait)


def held(task_id: str) -> tuple[str | None, int | None, int | None]:
    """What the task holds of the fleet: a lease, a due time (a message), a slot."""
    with transaction() as session:
        row = session.get(Task, task_id)
        assert row is not None
        return row.lease_owner, row.due_ms, row.admitted_ms


def test_a_completed_wait_is_the_calls_result_once(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], journal: Path
) -> None:
    task_id = start(client, tenant, [CI, {"content": "CI answered"}])
    assert drive(task_id) == "waiting"
    assert held(task_id) == (None, None, None)  # no lease, no message, no slot
    wait = the_wait(client, tenant, task_id)
    assert (wait["kind"], wait["tool"], wait["request"]) == (
        "token",
        "await_ci",
        {"run": "build-7"},
    )
    shown = client.get(f"/v1/waits/{wait['token']}", headers=tenant.headers).json()
    assert shown["status"] == "pending"
    body = {"conclusion": "success", "checks": 12}
    done = client.post(f"/v1/waits/{wait['token']}", json=body, headers=tenant.headers)
    assert done.status_code == 200, done.text
    assert done.json()["status"] == "completed"
    again = client.post(f"/v1/waits/{wait['token']}", json={"other": 1}, headers=tenant.headers)
    assert_problem(again, 409)
    assert drive(task_id) == "succeeded"
    steps = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()["items"]
    (call,) = steps[0]["tool_calls"]
    assert (call["status"], call["result"], call["runs"]) == ("succeeded", body, 1)
    assert call["wait"]["status"] == "completed"
    assert journal.read_text().count("ci ") == 1  # the tool ran once
    events = client.get(f"/v1/tasks/{task_id}/events", headers=tenant.headers).text
    assert "event: task.waiting" in events
    assert "event: wait.settled" in events


def test_the_signed_url_completes_a_wait_without_a_key(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    configure: Configure,
) -> None:
    configure(RATCHET_APPROVAL_LINK_SECRET="s" * 40, RATCHET_PUBLIC_URL="https://ratchet.example")
    task_id = start(client, tenant, [CI, {"content": "done"}])
    assert drive(task_id) == "waiting"
    url = urlsplit(the_wait(client, tenant, task_id)["url"])
    path, query = url.path, url.query
    forged = client.post(f"{path}?signature=AAAA{query[14:]}", json={"ok": True})
    assert_problem(forged, 404)
    done = client.post(f"{path}?{query}", json={"ok": True})
    assert done.status_code == 200, done.text
    assert_problem(client.post(f"{path}?{query}", json={"ok": True}), 409)  # single use
    assert drive(task_id) == "succeeded"


def test_another_tenants_key_cannot_see_or_complete_a_wait(
    client: TestClient,
    tenant: TenantHandle,
    make_tenant: Callable[..., TenantHandle],
    drive: Callable[..., str],
) -> None:
    task_id = start(client, tenant, [CI, {"content": "done"}])
    assert drive(task_id) == "waiting"
    token = the_wait(client, tenant, task_id)["token"]
    other = make_tenant()
    assert_problem(client.get(f"/v1/waits/{token}", headers=other.headers), 404)
    assert_problem(client.post(f"/v1/waits/{token}", json={}, headers=other.headers), 404)
    assert_problem(client.post(f"/v1/waits/{token}", json={}), 401)
    with transaction() as session:
        assert session.get(Wait, token).status == "pending"  # type: ignore[union-attr]


def test_bad_completions_change_nothing(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    task_id = start(client, tenant, [CI, {"content": "done"}])
    assert drive(task_id) == "waiting"
    token = the_wait(client, tenant, task_id)["token"]
    headers = tenant.headers | {"content-type": "application/json"}
    assert_problem(client.post(f"/v1/waits/{token}", content=b"{not json", headers=headers), 422)
    big = b'"' + b"x" * (300 * 1024) + b'"'
    assert client.post(f"/v1/waits/{token}", content=big, headers=headers).status_code in (413, 422)
    assert_problem(client.post("/v1/waits/wt_nope", json={}, headers=tenant.headers), 404)
    with transaction() as session:
        assert session.get(Wait, token).status == "pending"  # type: ignore[union-attr]


def expire_due(task_id: str) -> None:
    """Run the sweeper's deadline pass once the wait's deadline has passed on the database's
    clock: polled, never assumed."""
    from shared.store import waits
    from workers.sweeper import settle_waits

    for _ in range(200):
        with transaction() as session:
            due = [d for d in waits.due(session) if d[1] == task_id]
        if due:
            settle_waits(due, [], [])
            return
        time.sleep(0.05)
    raise AssertionError(f"task {task_id}: its wait never passed its deadline")


@pytest.mark.parametrize(
    ("policy", "task_status", "call_status"),
    [
        ("fail_call", "succeeded", "failed"),
        ("tell_model", "succeeded", "succeeded"),
        ("fail_task", "failed", None),
    ],
)
def test_an_expired_wait_follows_its_policy(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    configure: Configure,
    policy: str,
    task_status: str,
    call_status: str | None,
) -> None:
    configure(RATCHET_TEST_WAIT_S="0.05", RATCHET_TEST_WAIT_POLICY=policy)
    task_id = start(client, tenant, [CI, {"content": "done"}])
    assert drive(task_id) == "waiting"
    token = the_wait(client, tenant, task_id)["token"]
    expire_due(task_id)
    assert_problem(client.post(f"/v1/waits/{token}", json={}, headers=tenant.headers), 409)
    assert drive(task_id) == task_status
    task = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    if call_status is None:
        assert task["error"]["type"] == "wait_timeout"
        return
    (call,) = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()["items"][0][
        "tool_calls"
    ]
    assert call["status"] == call_status
    if policy == "tell_model":
        assert call["result"]["timed_out"] is True


def test_cancelling_a_waiting_task_settles_its_wait(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    task_id = start(client, tenant, [CI, {"content": "done"}])
    assert drive(task_id) == "waiting"
    token = the_wait(client, tenant, task_id)["token"]
    answer = client.post(f"/v1/tasks/{task_id}/cancel", headers=tenant.headers)
    assert answer.status_code == 202, answer.text
    assert answer.json()["status"] == "cancelled"
    assert_problem(client.post(f"/v1/waits/{token}", json={}, headers=tenant.headers), 409)
    with transaction() as session:
        assert session.get(Wait, token).status == "cancelled"  # type: ignore[union-attr]


def test_ask_user_asks_the_person_and_the_answer_is_the_result(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    ask = tool_turn("ask_user", question="Which region should I deploy to?")
    task_id = start(client, tenant, [ask, {"content": "deploying"}], agent="default")
    assert drive(task_id) == "waiting"
    wait = the_wait(client, tenant, task_id)
    assert wait["request"] == {"question": "Which region should I deploy to?"}
    assert wait["on_timeout"] == "tell_model"
    done = client.post(f"/v1/waits/{wait['token']}", json="eu-west-1", headers=tenant.headers)
    assert done.status_code == 200, done.text
    assert drive(task_id) == "succeeded"
    (call,) = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()["items"][0][
        "tool_calls"
    ]
    assert call["result"] == "eu-west-1"


def test_in_a_thread_the_next_message_answers_the_question_its_turn_asked(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    made = client.post("/v1/threads", json={"agent": "default"}, headers=tenant.headers)
    assert made.status_code == 201, made.text
    thread_id = made.json()["id"]
    ask = tool_turn("ask_user", question="Staging or production?")
    first = {
        "input": "deploy the release",
        "model": "scripted",
        "model_options": {"script": [ask, {"content": "deployed to staging"}]},
    }
    turn = client.post(f"/v1/threads/{thread_id}/runs", json=first, headers=tenant.headers)
    assert turn.status_code == 202, turn.text
    assert drive(turn.json()["id"]) == "waiting"
    thread = client.get(f"/v1/threads/{thread_id}", headers=tenant.headers).json()
    assert thread["status"] == "waiting"
    reply = client.post(
        f"/v1/threads/{thread_id}/runs", json={"input": "staging"}, headers=tenant.headers
    )
    assert reply.status_code == 202, reply.text
    assert reply.json()["id"] == turn.json()["id"]  # the answer, not a turn of its own
    assert "Idempotent-Replayed" not in reply.headers
    assert drive(turn.json()["id"]) == "succeeded"
    (call,) = client.get(f"/v1/tasks/{turn.json()['id']}/steps", headers=tenant.headers).json()[
        "items"
    ][0]["tool_calls"]
    assert call["result"] == "staging"
    with transaction() as session:
        assert session.query(Task).filter_by(thread_id=thread_id).count() == 1
