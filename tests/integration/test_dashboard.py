"""The dashboard over HTTP (no browser): who may log in, what a session may see and do, the
CSRF and origin checks, bulk actions that change exactly what they say, pages that never
carry a secret, and the JSON overview and task search behind them."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shared.ids import new_id
from shared.store.db import transaction
from shared.store.tables import Task, WebhookDelivery
from shared.webhooks import secrets as webhook_secrets
from tests.conftest import TenantHandle
from tests.helpers import calculator_script, tool_turn
from tests.integration.test_api import assert_problem, submit

pytestmark = pytest.mark.backends("postgresql", "sqlite")
OPERATOR = ("operator",)
ADMIN = ("admin",)
PAGES = ("", "/tasks", "/ratelimits", "/webhooks", "/tenants")


def login(client: TestClient, key: str) -> str:
    """Log in; returns the CSRF token of the session (read from a page's form)."""
    answer = client.post("/dashboard/login", data={"key": key}, follow_redirects=False)
    assert answer.status_code == 303, answer.text
    page = client.get("/dashboard/tasks")
    assert page.status_code == 200
    token = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
    assert token is not None
    return token.group(1)


def status_of(task_id: str) -> str:
    with transaction() as session:
        task = session.get(Task, task_id)
        assert task is not None
        return task.status


def failing(client: TestClient, tenant: TenantHandle, **extra: Any) -> str:
    """A task that fails at its second step: it may take only one."""
    script = [tool_turn("calculator", expression="1+1"), {"content": "never"}]
    return str(
        submit(
            client,
            tenant,
            tools=["calculator"],
            max_steps=1,
            model_options={"script": script},
            **extra,
        )["id"]
    )


def test_login_page_then_a_session_cookie_that_is_httponly_and_strict(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    admin = make_tenant(ADMIN)
    first = client.get("/dashboard", follow_redirects=False)
    assert first.status_code == 303
    assert first.headers["location"] == "/dashboard/login?next=/dashboard"
    assert 'type="password"' in client.get("/dashboard/login").text
    answer = client.post("/dashboard/login", data={"key": admin.key}, follow_redirects=False)
    assert answer.status_code == 303
    cookie = answer.headers["set-cookie"].lower()
    for part in ("httponly", "samesite=strict", "path=/dashboard", "max-age="):
        assert part in cookie
    assert admin.key.lower() not in cookie
    assert client.get("/dashboard").status_code == 200


def test_a_key_that_may_only_read_or_write_tasks_cannot_log_in(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    for scopes in (("tasks:read",), ("tasks:read", "tasks:write")):
        reader = make_tenant(scopes)
        answer = client.post("/dashboard/login", data={"key": reader.key}, follow_redirects=False)
        assert answer.status_code == 401
        assert "admin scope" in answer.text
        assert "set-cookie" not in answer.headers
    bad = client.post("/dashboard/login", data={"key": "rk_nope"}, follow_redirects=False)
    assert bad.status_code == 401


def test_logout_and_a_revoked_key_end_the_session(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    admin = make_tenant(ADMIN)
    token = login(client, admin.key)
    out = client.post("/dashboard/logout", data={"csrf_token": token}, follow_redirects=False)
    assert out.status_code == 303
    client.cookies.clear()
    assert client.get("/dashboard", follow_redirects=False).status_code == 303

    login(client, admin.key)
    keys = client.get("/v1/keys", headers=admin.headers).json()["items"]
    other = client.post("/v1/keys", json={"scopes": ["admin"]}, headers=admin.headers).json()
    revoked = client.post(
        f"/v1/keys/{keys[0]['id']}/revoke", headers={"Authorization": f"Bearer {other['key']}"}
    )
    assert revoked.status_code == 200, revoked.text
    assert client.get("/dashboard", follow_redirects=False).status_code == 303


def test_every_page_renders_and_the_fleet_pages_are_an_operators(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    operator, admin = make_tenant(OPERATOR), make_tenant(ADMIN)
    task = submit(client, admin)
    login(client, operator.key)
    for path in (*PAGES, "/workers", f"/tasks/{task['id']}", "?window=24h"):
        assert client.get(f"/dashboard{path}").status_code == 200, path
    client.cookies.clear()
    login(client, admin.key)
    for path in (*PAGES, f"/tasks/{task['id']}"):
        assert client.get(f"/dashboard{path}").status_code == 200, path
    assert client.get("/dashboard/workers").status_code == 403


def test_a_tenant_admin_sees_only_its_own_tenant(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    mine, theirs = make_tenant(ADMIN), make_tenant(ADMIN)
    own = submit(client, mine, metadata={"who": "me"})["id"]
    foreign = submit(client, theirs, metadata={"who": "them"})["id"]
    login(client, mine.key)
    listed = client.get("/dashboard/tasks").text
    assert own in listed
    assert foreign not in listed
    assert foreign not in client.get(f"/dashboard/tasks?tenant={theirs.name}").text
    assert client.get(f"/dashboard/tasks/{foreign}").status_code == 404
    assert theirs.name not in client.get("/dashboard").text
    cancel = client.post(
        f"/dashboard/tasks/{foreign}/cancel",
        data={"csrf_token": login(client, mine.key)},
        follow_redirects=False,
    )
    assert cancel.status_code == 404
    assert status_of(foreign) == "queued"


def test_actions_without_the_csrf_token_or_from_another_site_are_refused(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    admin = make_tenant(ADMIN)
    task_id = submit(client, admin)["id"]
    token = login(client, admin.key)
    for data in ({}, {"csrf_token": "forged"}):
        refused = client.post(f"/dashboard/tasks/{task_id}/cancel", data=data)
        assert refused.status_code == 403
        assert "CSRF" in refused.text
    foreign = client.post(
        f"/dashboard/tasks/{task_id}/cancel",
        data={"csrf_token": token},
        headers={"Origin": "https://evil.example"},
    )
    assert foreign.status_code == 403
    assert status_of(task_id) == "queued"
    done = client.post(
        f"/dashboard/tasks/{task_id}/cancel", data={"csrf_token": token}, follow_redirects=False
    )
    assert done.status_code == 303
    assert status_of(task_id) == "cancelled"


def test_bulk_retry_of_a_filter_retries_exactly_the_failed_tasks_it_matches(
    client: TestClient,
    make_tenant: Callable[..., TenantHandle],
    drive: Callable[..., str],
) -> None:
    admin = make_tenant(ADMIN)
    tagged = [failing(client, admin, metadata={"batch": "b1"}) for _ in range(3)]
    untagged = [failing(client, admin, metadata={"batch": "b2"}) for _ in range(2)]
    fine = submit(
        client, admin, metadata={"batch": "b1"}, model_options={"script": calculator_script(1)}
    )["id"]
    for task_id in (*tagged, *untagged, fine):
        drive(task_id)
    assert [status_of(t) for t in tagged + untagged] == ["failed"] * 5
    token = login(client, admin.key)
    form = {"csrf_token": token, "action": "retry:matching", "metadata": "batch:b1"}
    confirm = client.post("/dashboard/tasks/bulk", data=form)
    assert confirm.status_code == 200
    assert 'data-count="confirm">3<' in confirm.text
    assert all(status_of(t) == "failed" for t in tagged)  # nothing changes before "yes"
    done = client.post("/dashboard/tasks/bulk", data=form | {"confirmed": "yes"})
    assert done.status_code == 200
    assert "Retried 3 task(s)" in done.text
    assert [status_of(t) for t in tagged] == ["queued"] * 3
    assert [status_of(t) for t in untagged] == ["failed"] * 2
    assert status_of(fine) == "succeeded"


def test_no_page_carries_a_key_or_a_webhook_secret(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    operator = make_tenant(OPERATOR)
    task_id = submit(client, operator)["id"]
    with transaction() as session:
        secret = webhook_secrets.current(session, operator.id)
    login(client, operator.key)
    for path in (*PAGES, "/workers", f"/tasks/{task_id}", "/login"):
        html = client.get(f"/dashboard{path}").text
        assert operator.key not in html, path
        assert secret not in html, path


def test_the_json_overview_counts_a_tenants_tasks_and_the_fleets(
    client: TestClient, make_tenant: Callable[..., TenantHandle], drive: Callable[..., str]
) -> None:
    operator, admin = make_tenant(OPERATOR), make_tenant(ADMIN)
    done = submit(client, admin, model_options={"script": calculator_script(1)})["id"]
    drive(done)
    failed = failing(client, admin)
    drive(failed)
    submit(client, admin)
    mine = client.get("/v1/overview?window=1h", headers=admin.headers)
    assert mine.status_code == 200, mine.text
    body = mine.json()
    assert body["states"]["succeeded"] == 1
    assert body["states"]["failed"] == 1
    assert body["states"]["queued"] == 1
    assert sum(b["submitted"] for b in body["series"]) == 3
    assert body["usage"]["agent"][0]["tasks"] == 2
    assert body["errors"][0]["count"] == 1
    assert_problem(client.get("/v1/admin/overview", headers=admin.headers), 403)
    fleet = client.get(f"/v1/admin/overview?tenant={admin.name}", headers=operator.headers)
    assert fleet.json()["states"] == body["states"]
    found = client.get(
        f"/v1/admin/tasks?tenant={admin.name}&status=failed", headers=operator.headers
    )
    assert [t["id"] for t in found.json()["items"]] == [failed]
    kind = body["errors"][0]["type"]
    by_error = client.get(f"/v1/admin/tasks?error={kind}", headers=operator.headers).json()
    assert [t["id"] for t in by_error["items"]] == [failed]
    login(client, admin.key)
    overview_page = client.get("/dashboard").text
    assert f"error={kind}" in overview_page
    listed = client.get(f"/dashboard/tasks?status=failed&error={kind}").text
    assert failed in listed
    assert done not in listed
    assert_problem(client.get("/v1/admin/tasks?status=nope", headers=operator.headers), 422)


def test_failing_deliveries_are_listed_for_their_tenant_and_can_be_redelivered(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    admin, other = make_tenant(ADMIN), make_tenant(ADMIN)
    task_id = submit(client, admin)["id"]
    with transaction() as session:
        session.add(
            WebhookDelivery(
                id=new_id(),
                tenant_id=admin.id,
                task_id=task_id,
                event_seq=1,
                event_type="task.queued",
                url="https://hooks.example/down",
                payload={},
                status="failed",
                attempts=8,
                last_error="HTTP 503",
            )
        )
    token = login(client, admin.key)
    page = client.get("/dashboard/webhooks").text
    assert "https://hooks.example/down" in page
    assert "HTTP 503" in page
    delivery = re.search(r'data-delivery="([^"]+)"', page)
    assert delivery is not None
    again = client.post(
        f"/dashboard/tasks/{task_id}/deliveries/{delivery.group(1)}/redeliver",
        data={"csrf_token": token},
    )
    assert "Redelivery queued" in again.text
    with transaction() as session:
        row = session.get(WebhookDelivery, delivery.group(1))
        assert row is not None
        assert row.status == "pending"
    client.cookies.clear()
    login(client, other.key)
    assert "hooks.example/down" not in client.get("/dashboard/webhooks").text


def test_the_task_page_says_why_a_task_waits_and_lists_its_failed_model_calls(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    admin = make_tenant(ADMIN)
    task_id = submit(client, admin)["id"]
    failed_call = {
        "started_at": "2026-11-23T10:00:00+00:00",
        "latency_ms": 812,
        "error": {"type": "rate_limited", "message": "scripted: rate limited (429)"},
    }
    waiting = {"reason": "rate_limited", "scope": "model:openai:gpt-4o", "retry_in_ms": 4000}
    with transaction() as session:
        task = session.get(Task, task_id)
        assert task is not None
        task.waiting = waiting | {"model_attempts": [failed_call]}
    login(client, admin.key)
    page = client.get(f"/dashboard/tasks/{task_id}").text
    assert "rate limited</strong> on <code>model:openai:gpt-4o</code>, for 4.0 s" in page
    assert "812 ms" in page
    assert "scripted: rate limited (429)" in page


def test_the_approvals_queue_shows_waiting_calls_and_decides_them(
    client: TestClient, make_tenant: Callable[..., TenantHandle], drive: Callable[..., str]
) -> None:
    admin, other = make_tenant(ADMIN), make_tenant(ADMIN)
    wire = tool_turn("wire_money", to="alice", amount=900)
    body = {"agent": "ops", "model_options": {"script": [wire, {"content": "done"}]}}
    task_id = submit(client, admin, **body)["id"]
    assert drive(task_id) == "awaiting_approval"
    token = login(client, admin.key)
    queue = client.get("/dashboard/approvals").text
    assert task_id in queue
    assert "wire_money" in queue
    url = f"/dashboard/tasks/{task_id}/approvals/1-0"
    bad = client.post(url, data={"csrf_token": token, "decision": "edit", "arguments": "{"})
    assert "Not decided" in bad.text
    assert status_of(task_id) == "awaiting_approval"
    assert client.post(url, data={"decision": "approve"}).status_code == 403  # no CSRF token
    done = client.post(url, data={"csrf_token": token, "decision": "approve", "reason": "ok"})
    assert "approve recorded" in done.text
    assert status_of(task_id) == "running"
    assert drive(task_id) == "succeeded"
    page = client.get(f"/dashboard/tasks/{task_id}").text
    assert "approved by key:" in page
    # Neither is stored: the step's state comes from its completion, the key from the call.
    assert page.count('class="state state-completed"') == 2, page
    assert f"<code>{task_id}:1-0</code>" in page
    client.cookies.clear()
    other_token = login(client, other.key)
    assert task_id not in client.get("/dashboard/approvals").text
    foreign = client.post(url, data={"csrf_token": other_token, "decision": "reject"})
    assert "Not decided" in foreign.text


def test_threads_pages_show_a_tenants_own_threads_escaped_and_the_operator_all(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    mine, theirs = make_tenant(("tasks:read", "tasks:write", "admin")), make_tenant(ADMIN)
    operator = make_tenant(OPERATOR)
    made = client.post(
        "/v1/threads", json={"agent": "default", "metadata": {"who": "me"}}, headers=mine.headers
    )
    thread_id = made.json()["id"]
    hostile = "<script>alert(1)</script>"
    sent = client.post(
        f"/v1/threads/{thread_id}/runs",
        json={"input": hostile, "model": "scripted"},
        headers=mine.headers,
    )
    assert sent.status_code == 202, sent.text
    task_id = sent.json()["id"]

    login(client, mine.key)
    assert thread_id in client.get("/dashboard/threads?metadata=who:me").text
    assert thread_id not in client.get("/dashboard/threads?metadata=who:them").text
    page = client.get(f"/dashboard/threads/{thread_id}").text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert hostile not in page
    assert f'href="/dashboard/tasks/{task_id}"' in page
    # The queued turn is followed live: the page names its task's event stream.
    assert f'data-stream="/dashboard/tasks/{task_id}/events"' in page
    assert client.get("/dashboard/threads?metadata=nocolon").status_code == 200  # said, not 500

    login(client, theirs.key)
    assert thread_id not in client.get("/dashboard/threads").text
    assert client.get(f"/dashboard/threads/{thread_id}").status_code == 404
    assert client.get(f"/dashboard/tasks/{task_id}/events").status_code == 404

    login(client, operator.key)
    assert thread_id in client.get(f"/dashboard/threads?tenant={mine.name}").text
    assert client.get(f"/dashboard/threads/{thread_id}").status_code == 200


def test_a_tasks_event_stream_needs_a_session(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    task_id = submit(client, make_tenant(ADMIN))["id"]
    answer = client.get(f"/dashboard/tasks/{task_id}/events", follow_redirects=False)
    assert answer.status_code == 303
    assert answer.headers["location"].startswith("/dashboard/login")
