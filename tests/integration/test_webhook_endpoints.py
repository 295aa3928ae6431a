"""A tenant's default webhook endpoints over HTTP: add, list, read, change, disable, re-enable
and remove them; one tenant never reaches another's; bad input changes nothing; a disabled
endpoint is sent nothing new; and each shows how its last day's deliveries fared."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from shared.ids import new_id
from shared.store.db import transaction
from shared.store.outbox import DeliveryStatus
from shared.store.tables import ApiKey, WebhookDelivery, WebhookEndpoint, utcnow
from shared.webhooks import endpoints
from tests.conftest import TenantHandle
from tests.helpers import scripted_task
from tests.integration.test_api import assert_problem, error_fields
from workers import webhook_sender

pytestmark = pytest.mark.backends("postgresql", "sqlite")

PATH = "/v1/webhook-endpoints"
URL = "https://localhost/hooks/ratchet"  # allow-listed in the tests' environment
TERMINAL_EVENTS = ["task.cancelled", "task.failed", "task.succeeded"]


@pytest.fixture
def admin(make_tenant: Callable[..., TenantHandle]) -> TenantHandle:
    return make_tenant(("admin",))


@pytest.fixture
def held_back(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Deliveries committed from now on stay pending, not handed to the background sender."""
    held: list[str] = []
    monkeypatch.setattr(webhook_sender, "dispatch", held.extend)
    return held


def create(client: TestClient, tenant: TenantHandle, **body: Any) -> dict[str, Any]:
    response = client.post(PATH, json={"url": URL, **body}, headers=tenant.headers)
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


def patch(client: TestClient, tenant: TenantHandle, endpoint_id: str, **body: Any) -> Any:
    response = client.patch(f"{PATH}/{endpoint_id}", json=body, headers=tenant.headers)
    assert response.status_code == 200, response.text
    return response.json()


def endpoint_count(tenant_id: str) -> int:
    with transaction() as session:
        count = session.scalar(
            select(func.count())
            .select_from(WebhookEndpoint)
            .where(WebhookEndpoint.tenant_id == tenant_id)
        )
    assert count is not None
    return count


def endpoints_delivered_to(task_id: str) -> set[str | None]:
    with transaction() as session:
        return set(
            session.scalars(
                select(WebhookDelivery.endpoint_id).where(WebhookDelivery.task_id == task_id)
            )
        )


def run_task(client: TestClient, tenant: TenantHandle, drive: Callable[..., str]) -> str:
    body = scripted_task([{"content": "done"}])
    response = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert response.status_code == 202, response.text
    task_id: str = response.json()["id"]
    assert drive(task_id) == "succeeded"
    return task_id


# --- the verbs --------------------------------------------------------------------------------


def test_an_endpoint_is_added_read_listed_changed_and_removed(
    client: TestClient, admin: TenantHandle
) -> None:
    created = create(client, admin)

    assert set(created) == {
        "id",
        "url",
        "events",
        "enabled",
        "disabled_reason",
        "created_at",
        "deliveries",
        "circuit",
    }
    assert created["circuit"] == {"state": "closed", "consecutive_failures": 0, "until": None}
    assert created["url"] == URL
    assert created["events"] == TERMINAL_EVENTS  # the CLI's default too
    assert (created["enabled"], created["disabled_reason"]) == (True, None)
    assert created["deliveries"] == {"succeeded": 0, "failed": 0, "pending": 0}
    assert client.get(f"{PATH}/{created['id']}", headers=admin.headers).json() == created
    listed = client.get(PATH, headers=admin.headers).json()
    assert listed == {"items": [created], "next_cursor": None}

    changed = patch(
        client,
        admin,
        created["id"],
        url="https://localhost/hooks/v2",
        events=["task.succeeded", "task.queued", "task.succeeded"],
    )
    assert changed["url"] == "https://localhost/hooks/v2"
    assert changed["events"] == ["task.queued", "task.succeeded"]
    assert patch(client, admin, created["id"], events=["task.failed"])["url"] == changed["url"]

    deleted = client.delete(f"{PATH}/{created['id']}", headers=admin.headers)
    assert (deleted.status_code, deleted.content) == (204, b"")
    assert_problem(client.get(f"{PATH}/{created['id']}", headers=admin.headers), 404)
    assert_problem(client.delete(f"{PATH}/{created['id']}", headers=admin.headers), 404)
    assert endpoint_count(admin.id) == 0


def test_disabling_names_the_key_and_re_enabling_clears_the_reason(
    client: TestClient, admin: TenantHandle
) -> None:
    named = client.post(
        "/v1/keys", json={"name": "ops", "scopes": ["admin"]}, headers=admin.headers
    )
    ops = TenantHandle(id=admin.id, name=admin.name, key=named.json()["key"])
    endpoint_id = create(client, admin)["id"]

    disabled = patch(client, ops, endpoint_id, enabled=False)

    assert (disabled["enabled"], disabled["disabled_reason"]) == (False, "disabled by ops")
    # Disabled already: the first reason stands.
    assert patch(client, admin, endpoint_id, enabled=False)["disabled_reason"] == "disabled by ops"
    enabled = patch(client, admin, endpoint_id, enabled=True)
    assert (enabled["enabled"], enabled["disabled_reason"]) == (True, None)
    with transaction() as session:
        unnamed = session.scalar(
            select(ApiKey.id).where(ApiKey.tenant_id == admin.id, ApiKey.name.is_(None))
        )
    # A key without a name is named by its id.
    assert patch(client, admin, endpoint_id, enabled=False)["disabled_reason"] == (
        f"disabled by {unnamed}"
    )


def test_endpoints_are_listed_newest_first_a_page_at_a_time(
    client: TestClient, admin: TenantHandle
) -> None:
    made = [create(client, admin)["id"] for _ in range(3)]

    seen: list[str] = []
    params: dict[str, Any] = {"limit": 2}
    for _ in range(5):
        page = client.get(PATH, params=params, headers=admin.headers).json()
        seen += [e["id"] for e in page["items"]]
        if not page["next_cursor"]:
            break
        params["cursor"] = page["next_cursor"]

    assert seen == made[::-1]
    assert_problem(client.get(f"{PATH}?cursor=%%%", headers=admin.headers), 422)


# --- who may ----------------------------------------------------------------------------------


def test_another_tenants_endpoint_is_not_found_by_any_verb(
    client: TestClient, admin: TenantHandle, make_tenant: Callable[..., TenantHandle]
) -> None:
    other = make_tenant(("admin",))
    theirs = create(client, other)
    where = f"{PATH}/{theirs['id']}"

    assert client.get(PATH, headers=admin.headers).json()["items"] == []
    for response in (
        client.get(where, headers=admin.headers),
        client.patch(where, json={"url": URL}, headers=admin.headers),
        client.patch(where, json={"enabled": False}, headers=admin.headers),
        client.delete(where, headers=admin.headers),
    ):
        body = assert_problem(response, 404)
        assert body["detail"] == f"no webhook endpoint {theirs['id']}"  # as for a missing one
    assert client.get(where, headers=other.headers).json() == theirs


def test_a_key_without_the_admin_scope_is_refused(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    writer = make_tenant(("tasks:write",))

    assert_problem(client.get(PATH, headers=writer.headers), 403)
    assert_problem(client.post(PATH, json={"url": URL}, headers=writer.headers), 403)
    assert_problem(client.get(f"{PATH}/{new_id()}", headers=writer.headers), 403)
    assert endpoint_count(writer.id) == 0


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "http://example.com/hook"}, "url"),  # not https, not allow-listed
        ({"url": "https://10.1.2.3/hook"}, "url"),  # a private address
        ({"url": "ftp://localhost/hook"}, "url"),
        ({"url": "https://localhost/" + "a" * 2048}, "url"),
        ({"url": URL, "events": ["task.nope"]}, "events[0]"),
        ({"url": URL, "events": []}, "events"),
        ({"url": URL, "secret": "x"}, "secret"),
        ({"events": ["task.failed"]}, "url"),
    ],
)
def test_bad_input_is_a_422_naming_the_field_and_adds_nothing(
    client: TestClient, admin: TenantHandle, body: dict[str, Any], field: str
) -> None:
    problem = assert_problem(client.post(PATH, json=body, headers=admin.headers), 422)

    assert error_fields(problem) == [field]
    assert endpoint_count(admin.id) == 0


def test_a_change_with_bad_input_changes_nothing(client: TestClient, admin: TenantHandle) -> None:
    created = create(client, admin)
    where = f"{PATH}/{created['id']}"

    for body, field in (
        ({"url": "https://10.1.2.3/hook", "enabled": False}, "url"),
        ({"events": ["task.nope"]}, "events[0]"),
        ({"enabled": False, "reason": "x"}, "reason"),
    ):
        problem = assert_problem(client.patch(where, json=body, headers=admin.headers), 422)
        assert error_fields(problem) == [field]
    assert client.get(where, headers=admin.headers).json() == created


# --- what it is sent --------------------------------------------------------------------------


@pytest.mark.usefixtures("held_back")
def test_a_disabled_endpoint_is_sent_no_new_deliveries(
    client: TestClient, admin: TenantHandle, drive: Callable[..., str]
) -> None:
    off = create(client, admin, events=["task.succeeded"])["id"]
    on = create(client, admin, events=["task.succeeded"])["id"]
    patch(client, admin, off, enabled=False)

    assert endpoints_delivered_to(run_task(client, admin, drive)) == {on}
    patch(client, admin, off, enabled=True)
    assert endpoints_delivered_to(run_task(client, admin, drive)) == {on, off}
    assert client.delete(f"{PATH}/{on}", headers=admin.headers).status_code == 204
    assert endpoints_delivered_to(run_task(client, admin, drive)) == {off}


def test_each_endpoint_shows_its_last_days_deliveries_by_outcome(
    client: TestClient, admin: TenantHandle, make_tenant: Callable[..., TenantHandle]
) -> None:
    endpoint_id = create(client, admin)["id"]
    quiet_id = create(client, admin)["id"]
    task = client.post(
        "/v1/tasks", json=scripted_task([{"content": "ok"}]), headers=admin.headers
    ).json()
    now = utcnow()
    rows = [
        (DeliveryStatus.DELIVERED, now),
        (DeliveryStatus.DELIVERED, now),
        (DeliveryStatus.FAILED, now),
        (DeliveryStatus.DISABLED, now),
        (DeliveryStatus.PENDING, now),
        (DeliveryStatus.SENDING, now),
        (DeliveryStatus.DELIVERED, now - timedelta(hours=25)),  # before the window
    ]
    with transaction() as session:
        for seq, (status, created_at) in enumerate(rows, start=100):
            session.add(
                WebhookDelivery(
                    id=new_id(),
                    tenant_id=admin.id,
                    task_id=task["id"],
                    endpoint_id=endpoint_id,
                    event_seq=seq,
                    event_type="task.succeeded",
                    url=URL,
                    payload={},
                    status=status,
                    created_at=created_at,
                )
            )

    shown = client.get(f"{PATH}/{endpoint_id}", headers=admin.headers).json()
    assert shown["deliveries"] == {"succeeded": 2, "failed": 2, "pending": 2}
    listed = {
        e["id"]: e["deliveries"] for e in client.get(PATH, headers=admin.headers).json()["items"]
    }
    assert listed[endpoint_id] == shown["deliveries"]
    assert listed[quiet_id] == {"succeeded": 0, "failed": 0, "pending": 0}
    with transaction() as session:
        week = endpoints.success_rates(session, [endpoint_id, quiet_id], now - timedelta(days=7))
    assert week[endpoint_id] == endpoints.DeliveryCounts(succeeded=3, failed=2, pending=2)
    assert week[quiet_id] == endpoints.DeliveryCounts()


def test_the_operator_view_lists_every_tenants_endpoints(
    client: TestClient, admin: TenantHandle, make_tenant: Callable[..., TenantHandle]
) -> None:
    other = make_tenant(("admin",))
    mine, theirs = create(client, admin)["id"], create(client, other)["id"]

    with transaction() as session:
        everyone = {e.id for e in endpoints.list_for(session, None, limit=10_000)}
        only_mine = [e.id for e in endpoints.list_for(session, admin.id)]

    assert {mine, theirs} <= everyone
    assert only_mine == [mine]
