"""Tool calls that wait for a person: the task waits holding nothing, and each decision is
made once — approve runs the call once, edit runs it once with the new arguments, reject
never runs it and the model reads why; deadlines apply their policy once."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shared.store.db import transaction
from shared.store.ledger import CallStatus
from shared.store.tables import Task, ToolCall
from tests.conftest import Configure, TenantHandle
from tests.helpers import scripted_task, tool_turn
from tests.integration.test_api import assert_problem

pytestmark = pytest.mark.backends("postgresql", "sqlite")
WIRE = tool_turn("wire_money", to="alice", amount=900)
DONE = {"content": "done"}


def start(
    client: TestClient, tenant: TenantHandle, script: list[dict[str, Any]], **extra: Any
) -> str:
    body = scripted_task(script, agent="ops", **extra)
    answer = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert answer.status_code == 202, answer.text
    return str(answer.json()["id"])


def decide(
    client: TestClient, tenant: TenantHandle, task_id: str, call_id: str = "1-0", **body: Any
) -> Any:
    return client.post(
        f"/v1/tasks/{task_id}/approvals/{call_id}", json=body, headers=tenant.headers
    )


def past_deadline(task_id: str) -> list[tuple[str, str, str]]:
    """The task's waits once their deadline (10 ms after the wait began) has passed on the
    database's clock: polled, never assumed."""
    from shared.approvals import decisions

    for _ in range(200):
        with transaction() as session:
            due = [d for d in decisions.due(session) if d[0] == task_id]
        if due:
            return due
        time.sleep(0.05)
    raise AssertionError(f"task {task_id}: no wait passed its deadline")


def calls(task_id: str) -> list[ToolCall]:
    with transaction() as session:
        query = session.query(ToolCall).filter_by(task_id=task_id)
        rows = query.order_by(ToolCall.step_number, ToolCall.position).all()
        session.expunge_all()
        return rows


def test_approve_runs_the_call_once_and_the_task_succeeds(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], journal: Path
) -> None:
    task_id = start(client, tenant, [WIRE, DONE])
    assert drive(task_id) == "awaiting_approval"
    task = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    (pending,) = task["pending_approval"]["calls"]
    assert (pending["call_id"], pending["tool"]) == ("1-0", "wire_money")
    assert pending["arguments"] == {"to": "alice", "amount": 900}
    assert journal.read_text() == ""  # nothing ran while it waited
    answer = decide(client, tenant, task_id, decision="approve", reason="looks right")
    assert answer.status_code == 200, answer.text
    assert answer.json()["task"]["status"] == "running"
    assert drive(task_id) == "succeeded"
    assert journal.read_text().splitlines() == [f"wire {task_id}:1-0"]
    (call,) = calls(task_id)
    assert (call.status, call.decision, call.runs) == ("succeeded", "approve", 1)
    assert call.decided_by
    assert call.decided_by.startswith("key:")
    steps = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()
    approval = steps["items"][0]["tool_calls"][0]["approval"]
    assert (approval["decision"], approval["reason"]) == ("approve", "looks right")
    events = client.get(f"/v1/tasks/{task_id}/events", headers=tenant.headers).text
    assert "event: task.awaiting_approval" in events
    assert '"decision":"approve"' in events


def test_edit_runs_the_call_once_with_the_edited_arguments(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], journal: Path
) -> None:
    task_id = start(client, tenant, [WIRE, DONE])
    drive(task_id)
    bad = decide(client, tenant, task_id, decision="edit", arguments={"to": "bob"})
    assert assert_problem(bad, 422)["errors"][0]["field"] == "arguments"
    edit = {"to": "bob", "amount": 5}
    assert decide(client, tenant, task_id, decision="edit", arguments=edit).status_code == 200
    assert drive(task_id) == "succeeded"
    assert journal.read_text().splitlines() == [f"wire {task_id}:1-0"]
    (call,) = calls(task_id)
    assert (call.arguments, call.original_arguments) == (edit, {"to": "alice", "amount": 900})
    assert call.result == "wired 5 to bob"


def test_reject_never_runs_the_call_and_the_model_reads_why(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], journal: Path
) -> None:
    task_id = start(client, tenant, [WIRE])  # then the model answers with what it read last
    drive(task_id)
    answer = decide(client, tenant, task_id, decision="reject", reason="wrong account")
    assert answer.status_code == 200
    assert drive(task_id) == "succeeded"
    assert journal.read_text() == ""
    task = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    assert "rejected" in task["result"]["output"]
    assert "wrong account" in task["result"]["output"]
    (call,) = calls(task_id)
    assert (call.status, call.runs) == ("failed", 0)
    assert call.error
    assert "rejected" in call.error
    assert "wrong account" in call.error


def test_a_decision_is_made_once(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    task_id = start(client, tenant, [WIRE, DONE])
    drive(task_id)
    first = decide(client, tenant, task_id, decision="reject", reason="no")
    again = decide(client, tenant, task_id, decision="reject", reason="no")
    assert again.status_code == 200
    assert again.json()["replayed"] is True
    assert again.json()["decided_at"] == first.json()["decided_at"]
    assert_problem(decide(client, tenant, task_id, decision="approve"), 409)
    assert_problem(decide(client, tenant, task_id, "9-9", decision="approve"), 404)


def test_calls_that_need_no_approval_run_while_the_others_wait(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], journal: Path
) -> None:
    both = {
        "tool_calls": [
            {"name": "refund", "arguments": {"amount": 100}},  # under the predicate's line
            {"name": "refund", "arguments": {"amount": 600}},  # over it: waits
        ]
    }
    task_id = start(client, tenant, [both, DONE])
    assert drive(task_id) == "awaiting_approval"
    assert journal.read_text().splitlines() == [f"refund {task_id}:1-0"]
    assert [(c.call_id, c.status) for c in calls(task_id)] == [
        ("1-0", "succeeded"),
        ("1-1", "awaiting"),
    ]
    assert decide(client, tenant, task_id, "1-1", decision="approve").status_code == 200
    assert drive(task_id) == "succeeded"
    assert sorted(journal.read_text().splitlines()) == [
        f"refund {task_id}:1-0",
        f"refund {task_id}:1-1",
    ]


def test_a_submission_can_ask_for_approval_of_any_of_its_tools(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    script = [tool_turn("calculator", expression="6*7"), DONE]
    task_id = start(client, tenant, script, approval={"tools": ["calculator"]})
    assert drive(task_id) == "awaiting_approval"
    unknown = client.post(
        "/v1/tasks",
        json=scripted_task(script, agent="ops", approval={"tools": ["nope"]}),
        headers=tenant.headers,
    )
    assert assert_problem(unknown, 422)["errors"][0]["field"] == "approval.tools[0]"


def test_a_cancelled_tasks_waits_end(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    task_id = start(client, tenant, [WIRE, DONE])
    drive(task_id)
    assert client.post(f"/v1/tasks/{task_id}/cancel", headers=tenant.headers).status_code == 202
    assert client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()["status"] == (
        "cancelled"
    )
    assert_problem(decide(client, tenant, task_id, decision="approve"), 409)


@pytest.mark.parametrize(
    ("policy", "status"), [("reject", "succeeded"), ("approve", "succeeded"), ("fail", "failed")]
)
def test_a_deadline_applies_its_policy_once(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    journal: Path,
    policy: str,
    status: str,
) -> None:
    from workers.sweeper import expire_approvals

    approval = {"tools": [], "timeout_seconds": 0.01, "on_timeout": policy}
    task_id = start(client, tenant, [WIRE, DONE], approval=approval)
    drive(task_id)
    due = past_deadline(task_id)
    assert [(t, c) for t, c, _ in due] == [(task_id, "1-0")]
    expire_approvals(due * 2)  # twice: applied once
    late = "reject" if policy == "approve" else "approve"  # a person, after the deadline
    assert_problem(decide(client, tenant, task_id, decision=late), 409)
    assert drive(task_id) == status
    ran = journal.read_text().splitlines()
    assert ran == ([f"wire {task_id}:1-0"] if policy == "approve" else [])
    with transaction() as session:
        task = session.get(Task, task_id)
        assert task is not None
        if policy == "fail":
            assert task.error is not None
            assert task.error["type"] == "approval_timeout"


def test_who_may_decide(
    client: TestClient,
    make_tenant: Callable[..., TenantHandle],
    drive: Callable[..., str],
) -> None:
    from shared.store.tenants import create_key, get_tenant_by_name

    owner = make_tenant(("tasks:read", "tasks:write"))
    task_id = start(client, owner, [WIRE, DONE])
    drive(task_id)
    with transaction() as session:
        tenant = get_tenant_by_name(session, owner.name)
        reader = create_key(session, tenant, ("tasks:read",))
        approver = create_key(session, tenant, ("tasks:approve",))
    body = {"decision": "approve"}
    url = f"/v1/tasks/{task_id}/approvals/1-0"
    assert_problem(client.post(url, json=body, headers={"Authorization": f"Bearer {reader}"}), 403)
    answer = client.post(url, json=body, headers={"Authorization": f"Bearer {approver}"})
    assert answer.status_code == 200, answer.text
    stranger = make_tenant(("tasks:write",))
    assert_problem(decide(client, stranger, task_id, decision="approve"), 404)


@pytest.fixture
def links_on(configure: Configure) -> None:
    configure(RATCHET_APPROVAL_LINK_SECRET="k" * 40, RATCHET_PUBLIC_URL="https://ratchet.example")


def link_path(client: TestClient, tenant: TenantHandle, task_id: str) -> str:
    task = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    url = task["pending_approval"]["calls"][0]["approval_url"]
    assert url.startswith("https://ratchet.example/approve/")
    return str(url.removeprefix("https://ratchet.example"))


def test_an_approval_link_decides_once_without_a_key(
    links_on: None,
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    journal: Path,
) -> None:
    task_id = start(client, tenant, [WIRE, DONE])
    drive(task_id)
    path = link_path(client, tenant, task_id)
    shown = client.get(path)
    assert shown.status_code == 200
    assert "wire_money" in shown.text
    assert "alice" in shown.text
    assert status_of(task_id) == "awaiting_approval"  # looking decides nothing
    payload, signature = path.removeprefix("/approve/").split(".")
    forged = signature[:-2] + ("AA" if not signature.endswith("AA") else "BB")
    for bad in (f"/approve/{payload}.{forged}", f"/approve/{payload[:-2]}xx.{signature}"):
        assert client.get(bad).status_code == 403
        assert client.post(bad, data={"decision": "approve"}).status_code == 403
    used = client.post(path, data={"decision": "approve", "reason": "by mail"})
    assert used.status_code == 200
    assert "cannot be used again" in used.text
    again = client.post(path, data={"decision": "reject"})
    assert again.status_code == 409
    assert "already decided" in again.text
    assert drive(task_id) == "succeeded"
    assert journal.read_text().splitlines() == [f"wire {task_id}:1-0"]
    (call,) = calls(task_id)
    assert (call.decision, call.decided_by, call.decision_reason) == ("approve", "link", "by mail")


def test_an_expired_approval_link_changes_nothing(
    links_on: None, client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    approval = {"tools": [], "timeout_seconds": 0.01, "on_timeout": "fail"}
    task_id = start(client, tenant, [WIRE, DONE], approval=approval)
    drive(task_id)
    path = link_path(client, tenant, task_id)
    past_deadline(task_id)  # the link expires with the wait
    assert client.get(path).status_code == 410
    assert client.post(path, data={"decision": "approve"}).status_code == 410
    assert status_of(task_id) == "awaiting_approval"
    (call,) = calls(task_id)
    assert call.decision is None


def status_of(task_id: str) -> str:
    with transaction() as session:
        task = session.get(Task, task_id)
        assert task is not None
        return task.status


def test_a_task_failed_by_a_deadline_waits_again_when_retried(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], journal: Path
) -> None:
    from shared.approvals import decisions
    from workers.sweeper import expire_approvals

    approval = {"tools": [], "timeout_seconds": 0.01, "on_timeout": "fail"}
    task_id = start(client, tenant, [WIRE, DONE], approval=approval)
    drive(task_id)
    expire_approvals(past_deadline(task_id))
    assert status_of(task_id) == "failed"
    with transaction() as session:  # the retried wait gets a deadline it can meet
        session.query(Task).filter_by(id=task_id).update({"approval": {"timeout_seconds": 3600}})
    assert client.post(f"/v1/tasks/{task_id}/retry", headers=tenant.headers).status_code == 202
    assert drive(task_id) == "awaiting_approval"
    (call,) = calls(task_id)
    assert call.status == CallStatus.AWAITING
    with transaction() as session:
        assert [d for d in decisions.due(session) if d[0] == task_id] == []
    assert decide(client, tenant, task_id, decision="approve").status_code == 200
    assert drive(task_id) == "succeeded"
    assert journal.read_text().splitlines() == [f"wire {task_id}:1-0"]


@pytest.mark.parametrize(("decision", "runs"), [("approve", 2), ("reject", 1)])
def test_a_crash_mid_call_of_an_ask_tool_asks_a_person_whether_to_run_it_again(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    journal: Path,
    monkeypatch: pytest.MonkeyPatch,
    decision: str,
    runs: int,
) -> None:
    from shared.failpoints import InjectedFault
    from workers.steps import runner

    task_id = start(client, tenant, [tool_turn("ship_order", order="A-1"), DONE])
    monkeypatch.setenv("RATCHET_FAILPOINTS", "after_tool=raise")  # the run happened; then a crash
    with pytest.raises(InjectedFault):
        runner.advance(task_id, 1)
    monkeypatch.delenv("RATCHET_FAILPOINTS")
    with transaction() as session:
        session.query(Task).filter_by(id=task_id).update({"lease_expires_ms": 0})
    assert drive(task_id) == "awaiting_approval"
    task = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    (pending,) = task["pending_approval"]["calls"]
    assert "run it again" in pending["question"]
    assert decide(client, tenant, task_id, decision=decision).status_code == 200
    assert drive(task_id) == "succeeded"
    assert journal.read_text().splitlines() == [f"ship {task_id}:1-0"] * runs
    (call,) = calls(task_id)
    assert call.status == ("succeeded" if decision == "approve" else "failed")
    assert call.runs == runs


def test_an_abandoned_call_of_an_ask_tool_waits_for_a_person_and_the_rest_run_after(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    journal: Path,
    configure: Configure,
) -> None:
    # The calls one after the other: those after the abandoned one wait for the decision.
    # (Run at once, they run beside it: tests/integration/test_parallel_tools.py.)
    configure(RATCHET_TOOL_CONCURRENCY="1")
    turn = {
        "tool_calls": [
            {"name": "slow_ship", "arguments": {"seconds": 0.01}},
            {"name": "slow_ship", "arguments": {"seconds": 5}},  # abandoned at 0.2 s
            {"name": "upsert_record", "arguments": {"key": "after"}},
        ]
    }
    task_id = start(client, tenant, [turn, DONE])
    assert drive(task_id) == "awaiting_approval"
    assert [(c.call_id, c.status) for c in calls(task_id)] == [
        ("1-0", "succeeded"),
        ("1-1", "awaiting"),
    ]
    assert decide(client, tenant, task_id, "1-1", decision="reject").status_code == 200
    assert drive(task_id) == "succeeded"
    assert [(c.call_id, c.status) for c in calls(task_id)] == [
        ("1-0", "succeeded"),
        ("1-1", "failed"),
        ("1-2", "succeeded"),
    ]
    assert f"upsert {task_id}:1-2" in journal.read_text().splitlines()


def approval_urls(text: str) -> list[str]:
    """Every approval link in a response body (JSON or an event stream)."""
    return re.findall(r'"approval_url":\s*"([^"]+)"', text)


def test_an_approval_link_reaches_only_keys_that_may_decide(
    links_on: None,
    client: TestClient,
    make_tenant: Callable[..., TenantHandle],
    drive: Callable[..., str],
    journal: Path,
) -> None:
    from shared.store.tenants import create_key, get_tenant_by_name

    owner = make_tenant(("tasks:read", "tasks:write"))
    task_id = start(client, owner, [WIRE, DONE])
    assert drive(task_id) == "awaiting_approval"
    with transaction() as session:
        tenant = get_tenant_by_name(session, owner.name)
        reader_key = create_key(session, tenant, ("tasks:read",))
        approver_key = create_key(session, tenant, ("tasks:read", "tasks:approve"))
    reader = {"Authorization": f"Bearer {reader_key}"}
    approver = {"Authorization": f"Bearer {approver_key}"}
    reads = (f"/v1/tasks/{task_id}", "/v1/tasks?status=awaiting_approval")
    for path in (*reads, f"/v1/tasks/{task_id}/steps"):
        answer = client.get(path, headers=reader)
        assert answer.status_code == 200, answer.text
        assert approval_urls(answer.text) == [], path
    for path in reads:  # a key that may decide gets the link, as does one that may submit
        for headers in (approver, owner.headers):
            assert len(approval_urls(client.get(path, headers=headers).text)) == 1, path
    (link,) = approval_urls(client.get(f"/v1/tasks/{task_id}", headers=approver).text)
    used = client.post(link.removeprefix("https://ratchet.example"), data={"decision": "approve"})
    assert used.status_code == 200, used.text  # the link still decides, for whoever holds it
    assert drive(task_id) == "succeeded"
    assert journal.read_text().splitlines() == [f"wire {task_id}:1-0"]
    # The stream replays the wait's event (it ends at the terminal one): the reader's without
    # the link, the approver's with it.
    read = client.get(f"/v1/tasks/{task_id}/events", headers=reader).text
    assert "event: task.awaiting_approval" in read
    assert approval_urls(read) == []
    assert approval_urls(client.get(f"/v1/tasks/{task_id}/events", headers=approver).text) == [link]


@pytest.mark.parametrize("opted_in", [False, True])
def test_a_webhook_carries_an_approval_link_only_when_the_operator_opts_in(
    links_on: None,
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    configure: Configure,
    monkeypatch: pytest.MonkeyPatch,
    opted_in: bool,
) -> None:
    from tests.fakes.receiver import WebhookReceiver
    from workers import webhook_sender

    configure(RATCHET_WEBHOOK_APPROVAL_LINKS=str(opted_in).lower())
    held: list[str] = []  # the commits' deliveries, sent below rather than in the background
    monkeypatch.setattr(webhook_sender, "dispatch", held.extend)
    with WebhookReceiver() as receiver:
        hook = {"url": receiver.url(), "events": ["task.awaiting_approval"]}
        task_id = start(client, tenant, [WIRE, DONE], webhook=hook)
        assert drive(task_id) == "awaiting_approval"
        assert len(held) == 1
        for delivery_id in list(held):
            webhook_sender.attempt(delivery_id)  # sent here, on this thread
        [request] = receiver.wait_for(1)
    body = request.json()
    assert body["type"] == "task.awaiting_approval"
    (call,) = body["data"]["pending_approval"]["calls"]
    assert call["call_id"] == "1-0"
    assert ("approval_url" in call) is opted_in
