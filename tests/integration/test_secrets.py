"""Tenant secrets: set, listed (names and dates, never values), deleted and audited over HTTP;
handed to the tools that declare them and to no others; their values redacted from the
ledger, the events, webhooks, ``/steps``, the dashboard and the logs; another tenant's
invisible and unusable; rotated under a new key; bad input refused, changing nothing."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event as sqlalchemy_event
from sqlalchemy import select
from typer.testing import CliRunner

from ratchet.cli import app as cli
from shared.observability import logs
from shared.store import audit
from shared.store import tenant_secrets as secret_store
from shared.store.db import transaction
from shared.store.tables import Secret, TaskEvent, ToolCall
from shared.vault import SecretUnreadable, get_vault, new_key
from tests.conftest import Configure, TenantHandle
from tests.fakes.receiver import Received, WebhookReceiver
from tests.helpers import scripted_task, tool_turn
from tests.integration.test_api import assert_problem, submit
from tests.integration.test_dashboard import login
from tests.integration.test_webhooks import EVERY_EVENT

pytestmark = pytest.mark.backends("postgresql", "sqlite")

PATH = "/v1/secrets"
TOKEN = "tok-3f9a1c77e2b84d05-not-for-your-eyes"
MARKER = "[secret:DEPLOY_TOKEN]"
KEY = new_key()


@pytest.fixture
def keyed(configure: Configure) -> Configure:
    """The server has a secrets key."""
    configure(RATCHET_SECRETS_KEY=KEY)
    return configure


@pytest.fixture
def admin(make_tenant: Callable[..., TenantHandle]) -> TenantHandle:
    return make_tenant(("admin",))


@pytest.fixture
def worker_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """The process's own log handler (as a worker configures it), writing to a buffer."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    buffer = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buffer)
    logs.configure(log_format="json", level="INFO")
    try:
        yield buffer
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        logging.captureWarnings(False)


def put(client: TestClient, tenant: TenantHandle, name: str, value: str) -> Any:
    return client.put(f"{PATH}/{name}", json={"value": value}, headers=tenant.headers)


def listed(client: TestClient, tenant: TenantHandle) -> list[dict[str, Any]]:
    response = client.get(PATH, headers=tenant.headers)
    assert response.status_code == 200, response.text
    items: list[dict[str, Any]] = response.json()["items"]
    return items


def stored_rows(tenant_id: str) -> list[tuple[str, str]]:
    with transaction() as session:
        rows = session.execute(
            select(Secret.name, Secret.ciphertext).where(Secret.tenant_id == tenant_id)
        ).all()
    return sorted((name, text) for name, text in rows)


def deploy(client: TestClient, tenant: TenantHandle, **extra: Any) -> dict[str, Any]:
    script = [
        tool_turn("use_token"),
        tool_turn("peek_secrets"),
        tool_turn("use_token", fail=True),
        {"content": "deployed"},
    ]
    return submit(client, tenant, **scripted_task(script, agent="deployer") | extra)


def tool_results(task_id: str) -> dict[str, list[Any]]:
    with transaction() as session:
        rows = session.scalars(
            select(ToolCall).where(ToolCall.task_id == task_id).order_by(ToolCall.call_id)
        ).all()
        found: dict[str, list[Any]] = {}
        for row in rows:
            found.setdefault(row.tool, []).append(row.result if row.result else row.error)
    return found


def until_delivered(receiver: WebhookReceiver, *, calls: int) -> list[Received]:
    """Every webhook of a task, once its ``calls`` tool calls and its end have arrived."""
    for count in range(1, 100):
        received = receiver.wait_for(count)
        types = [request.json()["type"] for request in received]
        if types.count("step.tool_call") == calls and "task.succeeded" in types:
            return received
    raise AssertionError("the task's webhooks did not all arrive")


# --- the API -------------------------------------------------------------------------------


def test_a_secret_is_set_replaced_listed_without_its_value_and_deleted(
    client: TestClient, admin: TenantHandle, keyed: Configure
) -> None:
    created = put(client, admin, "DEPLOY_TOKEN", TOKEN)
    assert created.status_code == 201, created.text
    assert TOKEN not in created.text
    replaced = put(client, admin, "DEPLOY_TOKEN", TOKEN + "-2")
    assert replaced.status_code == 200, replaced.text
    assert replaced.json()["created_at"] == created.json()["created_at"]
    assert replaced.json()["updated_at"] > created.json()["updated_at"]
    assert put(client, admin, "API_KEY", "x").status_code == 201

    page = client.get(PATH, headers=admin.headers, params={"limit": 1}).json()
    assert [item["name"] for item in page["items"]] == ["API_KEY"]
    rest = client.get(PATH, headers=admin.headers, params={"cursor": page["next_cursor"]})
    assert [item["name"] for item in rest.json()["items"]] == ["DEPLOY_TOKEN"]
    assert set(rest.json()["items"][0]) == {"name", "created_at", "updated_at"}
    assert TOKEN not in client.get(PATH, headers=admin.headers).text

    # Encrypted at rest: the stored text is not the value.
    assert all(TOKEN not in text for _, text in stored_rows(admin.id))

    assert client.delete(f"{PATH}/DEPLOY_TOKEN", headers=admin.headers).status_code == 204
    assert_problem(client.delete(f"{PATH}/DEPLOY_TOKEN", headers=admin.headers), 404)
    assert [item["name"] for item in listed(client, admin)] == ["API_KEY"]


def test_each_change_is_audited_with_the_key_that_made_it(
    client: TestClient, admin: TenantHandle, keyed: Configure
) -> None:
    put(client, admin, "DEPLOY_TOKEN", TOKEN)
    put(client, admin, "DEPLOY_TOKEN", TOKEN + "-2")
    client.delete(f"{PATH}/DEPLOY_TOKEN", headers=admin.headers)
    with transaction() as session:
        entries = [(e.action, e.target, e.actor) for e in audit.list_for(session, admin.id)]
    assert [entry[:2] for entry in entries] == [
        ("secret.delete", "DEPLOY_TOKEN"),
        ("secret.set", "DEPLOY_TOKEN"),
        ("secret.set", "DEPLOY_TOKEN"),
    ]
    assert {actor for _, _, actor in entries} == {
        audit.actor_of_key(client.get("/v1/keys", headers=admin.headers).json()["items"][0]["id"])
    }
    shown = CliRunner().invoke(cli, ["secrets", "audit", "--tenant", admin.name])
    assert shown.exit_code == 0, shown.output
    assert [entry["action"] for entry in json.loads(shown.stdout)] == [
        "secret.delete",
        "secret.set",
        "secret.set",
    ]
    assert TOKEN not in shown.output


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("lower_case", {"value": "v"}),
        ("1LEADING_DIGIT", {"value": "v"}),
        ("A" * 65, {"value": "v"}),
        ("HAS-DASH", {"value": "v"}),
        ("GOOD", {"value": ""}),
        ("GOOD", {"value": "x" * (64 * 1024 + 1)}),
        ("GOOD", {"value": "é" * (32 * 1024 + 1)}),  # under 64 Ki characters, over 64 KiB
        ("GOOD", {"value": 42}),
        ("GOOD", {"value": "v", "extra": 1}),
        ("GOOD", {}),
    ],
)
def test_bad_names_and_values_are_422_and_change_nothing(
    client: TestClient, admin: TenantHandle, keyed: Configure, name: str, body: Any
) -> None:
    response = client.put(f"{PATH}/{name}", json=body, headers=admin.headers)
    assert_problem(response, 422)
    assert stored_rows(admin.id) == []
    with transaction() as session:
        assert audit.list_for(session, admin.id) == []


def test_the_largest_value_is_taken(
    client: TestClient, admin: TenantHandle, keyed: Configure
) -> None:
    assert put(client, admin, "BIG", "x" * 64 * 1024).status_code == 201


def test_secrets_need_the_admin_scope(
    client: TestClient, make_tenant: Callable[..., TenantHandle], keyed: Configure
) -> None:
    writer = make_tenant(("tasks:read", "tasks:write"))
    assert_problem(put(client, writer, "DEPLOY_TOKEN", TOKEN), 403)
    assert_problem(client.get(PATH, headers=writer.headers), 403)
    assert_problem(client.delete(f"{PATH}/DEPLOY_TOKEN", headers=writer.headers), 403)


def test_another_tenants_secrets_are_invisible_and_not_found(
    client: TestClient, make_tenant: Callable[..., TenantHandle], keyed: Configure
) -> None:
    owner, other = make_tenant(("admin",)), make_tenant(("admin",))
    put(client, owner, "DEPLOY_TOKEN", TOKEN)
    assert listed(client, other) == []
    assert_problem(client.delete(f"{PATH}/DEPLOY_TOKEN", headers=other.headers), 404)
    assert [item["name"] for item in listed(client, owner)] == ["DEPLOY_TOKEN"]


def test_without_a_key_setting_a_secret_is_a_clear_409(
    client: TestClient, admin: TenantHandle, configure: Configure
) -> None:
    configure(RATCHET_SECRETS_KEY=None)
    problem = assert_problem(put(client, admin, "DEPLOY_TOKEN", TOKEN), 409)
    assert "set RATCHET_SECRETS_KEY" in problem["detail"]
    assert stored_rows(admin.id) == []


# --- delivery to tools and redaction --------------------------------------------------------


def test_a_secret_reaches_the_tool_that_declares_it_and_is_redacted_everywhere(
    client: TestClient,
    admin: TenantHandle,
    keyed: Configure,
    drive: Callable[..., str],
    worker_log: io.StringIO,
) -> None:
    assert put(client, admin, "DEPLOY_TOKEN", TOKEN).status_code == 201
    put(client, admin, "OTHER_SECRET", "other-value-kept-from-tools")
    with WebhookReceiver() as receiver:
        task = deploy(client, admin, webhook={"url": receiver.url(), "events": EVERY_EVENT})
        assert drive(task["id"]) == "succeeded"
        received = until_delivered(receiver, calls=3)
        hooks = "\n".join(request.body.decode() for request in received)

    results = tool_results(task["id"])
    # The declaring tool was handed the secret (its result says so, redacted); the other
    # tool was handed none, though the tenant has two.
    first, failed = results["use_token"]
    assert first == {"names": ["DEPLOY_TOKEN"], "token": MARKER, "echo": {MARKER: [MARKER]}}
    assert results["peek_secrets"] == [{"names": [], "values": []}]
    assert failed == f"use_token raised RuntimeError: the deploy server refused token {MARKER}"

    with transaction() as session:
        ledger = json.dumps([[c.result, c.error] for c in session.scalars(select(ToolCall)).all()])
        events = json.dumps(
            [
                e.data
                for e in session.scalars(select(TaskEvent).where(TaskEvent.task_id == task["id"]))
            ]
        )
    steps = client.get(f"/v1/tasks/{task['id']}/steps", headers=admin.headers).text
    stream = client.get(f"/v1/tasks/{task['id']}/events", headers=admin.headers).text
    answer = client.get(f"/v1/tasks/{task['id']}", headers=admin.headers).text
    login(client, admin.key)
    page = client.get(f"/dashboard/tasks/{task['id']}")
    assert page.status_code == 200
    log_text = worker_log.getvalue()

    shown = {
        "ledger": ledger,
        "events": events,
        "stream": stream,
        "steps": steps,
        "task": answer,
        "webhooks": hooks,
        "dashboard": page.text,
        "log": log_text,
    }
    assert {where for where, text in shown.items() if TOKEN in text} == set()
    assert "other-value-kept-from-tools" not in "".join(shown.values())
    # What was there instead: the marker.
    for where in ("ledger", "stream", "steps", "webhooks", "dashboard", "log"):
        assert "secret:DEPLOY_TOKEN" in shown[where], where
    assert "deploying with token [secret:DEPLOY_TOKEN]" in log_text


def test_a_tool_that_declares_no_secret_costs_no_query_one_that_does_one(
    client: TestClient, admin: TenantHandle, keyed: Configure
) -> None:
    from shared.agents.registry import get_registry
    from shared.store.db import get_engine
    from workers import tool_secrets

    put(client, admin, "DEPLOY_TOKEN", TOKEN)
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(args[2])

    tools = get_registry().tools
    sqlalchemy_event.listen(get_engine(), "before_cursor_execute", count)
    try:
        assert tool_secrets.for_call(admin.id, tools["peek_secrets"]) == {}
        assert statements == []
        assert tool_secrets.for_call(admin.id, tools["use_token"]) == {"DEPLOY_TOKEN": TOKEN}
        assert len([s for s in statements if "secrets" in s]) == 1
    finally:
        sqlalchemy_event.remove(get_engine(), "before_cursor_execute", count)


def test_another_tenants_task_is_handed_nothing(
    client: TestClient,
    make_tenant: Callable[..., TenantHandle],
    keyed: Configure,
    drive: Callable[..., str],
) -> None:
    owner, other = make_tenant(("admin",)), make_tenant(("admin",))
    put(client, owner, "DEPLOY_TOKEN", TOKEN)
    task = deploy(client, other)
    assert drive(task["id"]) == "succeeded"
    first, failed = tool_results(task["id"])["use_token"]
    assert first == {"names": [], "token": None, "echo": {"None": [None]}}
    assert failed == "use_token raised RuntimeError: the deploy server refused token None"


def test_without_a_key_a_tool_that_declares_secrets_fails_its_call_clearly(
    client: TestClient, admin: TenantHandle, configure: Configure, drive: Callable[..., str]
) -> None:
    configure(RATCHET_SECRETS_KEY=None)
    task = deploy(client, admin)
    assert drive(task["id"]) == "succeeded"  # the model is told, as of any failed call
    first, _ = tool_results(task["id"])["use_token"]
    assert first.startswith("use_token cannot run: secrets are not configured")
    assert "RATCHET_SECRETS_KEY" in first
    assert tool_results(task["id"])["peek_secrets"] == [{"names": [], "values": []}]


# --- rotation -------------------------------------------------------------------------------


def test_rotation_reencrypts_under_the_new_key_and_the_old_one_can_go(
    client: TestClient, admin: TenantHandle, configure: Configure, drive: Callable[..., str]
) -> None:
    old, new = new_key(), new_key()
    configure(RATCHET_SECRETS_KEY=old)
    put(client, admin, "DEPLOY_TOKEN", TOKEN)
    put(client, admin, "API_KEY", "api-key-value")
    before = stored_rows(admin.id)

    configure(RATCHET_SECRETS_KEY=f"{new},{old}")
    runner = CliRunner()
    first = runner.invoke(cli, ["secrets", "reencrypt"])
    assert first.exit_code == 0, first.output
    after = stored_rows(admin.id)
    assert all(a != b for (_, a), (_, b) in zip(before, after, strict=True))
    again = runner.invoke(cli, ["secrets", "reencrypt"])  # idempotent: nothing to rewrite
    assert again.exit_code == 0, again.output
    assert "0 re-encrypted" in again.output
    assert stored_rows(admin.id) == after

    configure(RATCHET_SECRETS_KEY=new)  # the old key removed
    with transaction() as session:
        values = secret_store.values_for(
            session, admin.id, ["DEPLOY_TOKEN", "API_KEY"], vault=get_vault()
        )
    assert values == {"DEPLOY_TOKEN": TOKEN, "API_KEY": "api-key-value"}
    task = deploy(client, admin)
    assert drive(task["id"]) == "succeeded"
    assert tool_results(task["id"])["use_token"][0]["names"] == ["DEPLOY_TOKEN"]

    configure(RATCHET_SECRETS_KEY=old)  # only the removed key: nothing opens
    with transaction() as session, pytest.raises(SecretUnreadable, match="DEPLOY_TOKEN"):
        secret_store.values_for(session, admin.id, ["DEPLOY_TOKEN"], vault=get_vault())
    refused = runner.invoke(cli, ["secrets", "reencrypt"])
    assert refused.exit_code == 1
    assert TOKEN not in refused.output
