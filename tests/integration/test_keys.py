"""API keys over HTTP: list, create, revoke, rotate and expire them; the operator / tenant
admin split; and strict parsing of the key a request carries."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from sqlalchemy import event, func, select, update

from api.deps import verified_keys
from shared.store.db import get_engine, transaction
from shared.store.tables import ApiKey
from tests.conftest import Configure, TenantHandle
from tests.integration.test_api import assert_problem, task_count

pytestmark = pytest.mark.backends("postgresql", "sqlite")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def key_row(key_id: str) -> ApiKey:
    with transaction() as session:
        row = session.get(ApiKey, key_id)
        assert row is not None
        session.expunge(row)
        return row


def key_count(tenant_id: str) -> int:
    with transaction() as session:
        count = session.scalar(
            select(func.count()).select_from(ApiKey).where(ApiKey.tenant_id == tenant_id)
        )
    assert count is not None
    return count


def set_key_column(key_id: str, **values: Any) -> None:
    with transaction() as session:
        session.execute(update(ApiKey).where(ApiKey.id == key_id).values(**values))


def create(client: TestClient, admin: TenantHandle, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/keys", json=body, headers=admin.headers)
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


@pytest.fixture
def admin(make_tenant: Callable[..., TenantHandle]) -> TenantHandle:
    return make_tenant(("admin",))


# --- item 4: list, create, revoke, rotate, expire ---------------------------------------------


def test_a_created_key_is_shown_once_and_listed_by_prefix_never_by_hash(
    client: TestClient, admin: TenantHandle
) -> None:
    created = create(client, admin, name="ci", scopes=["tasks:read"])

    assert created["key"].startswith(created["prefix"])
    assert created["name"] == "ci"
    assert created["scopes"] == ["tasks:read"]
    assert client.get("/v1/tasks", headers=bearer(created["key"])).status_code == 200
    listed = client.get("/v1/keys", headers=admin.headers)
    assert listed.status_code == 200, listed.text
    items = {k["id"]: k for k in listed.json()["items"]}
    assert len(items) == 2  # the admin's own key and the new one
    mine = items[created["id"]]
    assert set(mine) == {
        "id",
        "prefix",
        "name",
        "scopes",
        "created_at",
        "expires_at",
        "last_used_at",
        "revoked_at",
    }
    assert mine["last_used_at"] is not None  # it was just used to list tasks
    assert created["key"] not in listed.text
    assert key_row(created["id"]).key_hash not in listed.text


def test_keys_are_listed_a_page_at_a_time(client: TestClient, admin: TenantHandle) -> None:
    made = {create(client, admin, name=f"k{n}")["id"] for n in range(3)}

    seen: list[str] = []
    params: dict[str, Any] = {"limit": 2}
    for _ in range(5):
        page = client.get("/v1/keys", params=params, headers=admin.headers).json()
        seen += [k["id"] for k in page["items"]]
        if not page["next_cursor"]:
            break
        params["cursor"] = page["next_cursor"]

    assert len(seen) == 4 == len(set(seen))
    assert made < set(seen)
    assert_problem(client.get("/v1/keys?cursor=%%%", headers=admin.headers), 422)


def test_last_use_is_written_at_most_once_a_minute_per_key(
    client: TestClient, tenant: TenantHandle
) -> None:
    updates: list[str] = []

    def count(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("UPDATE API_KEYS"):
            updates.append(statement)

    engine = get_engine()
    event.listen(engine, "before_cursor_execute", count)
    try:
        for _ in range(20):
            assert client.get("/v1/tasks", headers=tenant.headers).status_code == 200
    finally:
        event.remove(engine, "before_cursor_execute", count)

    assert len(updates) == 1, updates
    [key_id] = [k.id for k in _keys_of(tenant.id)]
    first_use = key_row(key_id).last_used_at
    assert first_use is not None
    # A minute later (moved back rather than waited for), the next request writes it again.
    set_key_column(key_id, last_used_at=datetime.now(UTC) - timedelta(seconds=90))
    verified_keys.clear()  # and so is the second the API remembers a verified key
    assert client.get("/v1/tasks", headers=tenant.headers).status_code == 200
    again = key_row(key_id).last_used_at
    assert again is not None
    assert again.replace(tzinfo=UTC) > datetime.now(UTC) - timedelta(seconds=60)


def _keys_of(tenant_id: str) -> list[ApiKey]:
    with transaction() as session:
        rows = list(session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id)))
        session.expunge_all()
        return rows


def test_a_revoked_key_is_refused_on_its_next_request(
    client: TestClient, admin: TenantHandle
) -> None:
    created = create(client, admin)
    assert client.get("/v1/tasks", headers=bearer(created["key"])).status_code == 200

    revoked = client.post(f"/v1/keys/{created['id']}/revoke", headers=admin.headers)

    assert revoked.status_code == 200, revoked.text
    assert revoked.json()["revoked_at"] is not None
    body = assert_problem(client.get("/v1/tasks", headers=bearer(created["key"])), 401)
    assert "revoked" in body["detail"]
    assert client.post(f"/v1/keys/{created['id']}/revoke", headers=admin.headers).is_success


def test_an_expired_key_is_401_saying_it_expired(client: TestClient, admin: TenantHandle) -> None:
    created = create(client, admin, expires_in_seconds=3600)
    assert created["expires_at"] is not None
    assert client.get("/v1/tasks", headers=bearer(created["key"])).status_code == 200

    # An hour on (moved back rather than waited for):
    set_key_column(created["id"], expires_at=datetime.now(UTC) - timedelta(seconds=1))
    verified_keys.clear()  # and so is the second the API remembers a verified key

    body = assert_problem(client.get("/v1/tasks", headers=bearer(created["key"])), 401)
    assert "expired" in body["detail"]


@pytest.mark.parametrize(
    "body",
    [
        {"expires_at": "2001-01-01T00:00:00Z"},
        {"expires_at": "2999-01-01T00:00:00"},  # no time zone
        {"expires_in_seconds": 0},
        {"expires_in_seconds": 60, "expires_at": "2999-01-01T00:00:00Z"},
        {"scopes": ["tasks:read", "everything"]},
        {"scopes": []},
        {"name": ""},
        {"colour": "blue"},
    ],
)
def test_a_bad_key_request_is_422_and_creates_nothing(
    client: TestClient, admin: TenantHandle, body: dict[str, Any]
) -> None:
    assert_problem(client.post("/v1/keys", json=body, headers=admin.headers), 422)
    assert key_count(admin.id) == 1


def test_rotation_makes_a_like_key_and_the_old_one_stops_after_its_grace(
    client: TestClient, admin: TenantHandle
) -> None:
    old = create(client, admin, name="deploy", scopes=["tasks:read"], expires_in_seconds=86400)

    rotated = client.post(
        f"/v1/keys/{old['id']}/rotate", json={"grace_seconds": 3600}, headers=admin.headers
    )

    assert rotated.status_code == 201, rotated.text
    new = rotated.json()
    assert new["id"] != old["id"]
    assert (new["name"], new["scopes"]) == ("deploy", ["tasks:read"])
    assert new["expires_at"] is not None  # the same lifetime as the old key, from now
    assert client.get("/v1/tasks", headers=bearer(new["key"])).status_code == 200
    # In its grace period the old key still works ...
    assert client.get("/v1/tasks", headers=bearer(old["key"])).status_code == 200
    # ... it cannot be rotated twice ...
    assert_problem(client.post(f"/v1/keys/{old['id']}/rotate", headers=admin.headers), 409)
    # ... and a revoke ends the grace at once.
    client.post(f"/v1/keys/{old['id']}/revoke", headers=admin.headers).raise_for_status()
    assert_problem(client.get("/v1/tasks", headers=bearer(old["key"])), 401)


def test_rotation_without_grace_stops_the_old_key_at_once(
    client: TestClient, admin: TenantHandle
) -> None:
    old = create(client, admin)

    new = client.post(f"/v1/keys/{old['id']}/rotate", headers=admin.headers).json()

    assert client.get("/v1/tasks", headers=bearer(new["key"])).status_code == 200
    assert_problem(client.get("/v1/tasks", headers=bearer(old["key"])), 401)


def test_a_tenant_admin_manages_only_its_own_keys(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    alice, bob = make_tenant(("admin",)), make_tenant(("admin",))
    [bobs_key] = _keys_of(bob.id)

    for action in ("revoke", "rotate"):
        assert_problem(client.post(f"/v1/keys/{bobs_key.id}/{action}", headers=alice.headers), 404)
    listed = client.get("/v1/keys", headers=alice.headers).json()["items"]

    assert bobs_key.id not in {k["id"] for k in listed}
    assert key_row(bobs_key.id).revoked_at is None
    assert key_count(bob.id) == 1
    assert client.get("/v1/tasks", headers=bob.headers).status_code == 200


def test_keys_need_the_admin_scope(client: TestClient, tenant: TenantHandle) -> None:
    assert_problem(client.get("/v1/keys", headers=tenant.headers), 403)
    assert_problem(client.post("/v1/keys", json={}, headers=tenant.headers), 403)
    assert key_count(tenant.id) == 1


# --- item 5: operator and tenant admin --------------------------------------------------------


def test_http_never_grants_the_operator_scope(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    admin, operator = make_tenant(("admin",)), make_tenant(("operator",))

    for caller in (admin, operator):
        body = assert_problem(
            client.post("/v1/keys", json={"scopes": ["operator"]}, headers=caller.headers), 422
        )
        assert "CLI" in body["detail"]
        assert key_count(caller.id) == 1
    [operator_key] = _keys_of(operator.id)
    assert_problem(client.post(f"/v1/keys/{operator_key.id}/rotate", headers=operator.headers), 403)
    assert key_row(operator_key.id).revoked_at is None


def test_a_tenant_admin_cannot_revoke_or_rotate_its_tenants_operator_key(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    from shared.store.tenants import create_key, get_tenant_by_name

    operator = make_tenant(("operator",))
    with transaction() as session:
        admin_key = create_key(session, get_tenant_by_name(session, operator.name), ("admin",))
    [operator_key] = [k for k in _keys_of(operator.id) if "operator" in k.scopes]

    for action in ("revoke", "rotate"):
        body = assert_problem(
            client.post(f"/v1/keys/{operator_key.id}/{action}", headers=bearer(admin_key)), 403
        )
        assert "operator" in body["detail"]
    assert key_row(operator_key.id).revoked_at is None
    assert key_count(operator.id) == 2
    assert client.get("/v1/admin/ratelimits", headers=operator.headers).status_code == 200
    # An operator may revoke one (a leaked operator key is stopped without the CLI).
    revoked = client.post(f"/v1/keys/{operator_key.id}/revoke", headers=operator.headers)
    assert revoked.status_code == 200, revoked.text
    assert_problem(client.get("/v1/admin/ratelimits", headers=operator.headers), 401)


def test_an_expired_key_does_not_rotate_into_a_live_one(
    client: TestClient, admin: TenantHandle
) -> None:
    old = create(client, admin, scopes=["tasks:read"], expires_in_seconds=3600)
    # Its hour long since over (moved back rather than waited for):
    now = datetime.now(UTC)
    set_key_column(
        old["id"], created_at=now - timedelta(hours=2), expires_at=now - timedelta(hours=1)
    )

    body = assert_problem(client.post(f"/v1/keys/{old['id']}/rotate", headers=admin.headers), 409)

    assert "expired" in body["detail"]
    assert key_count(admin.id) == 2  # the admin's own key and the expired one: nothing new
    assert key_row(old["id"]).revoked_at is None


@pytest.fixture
def key_cap(configure: Configure) -> int:
    configure(RATCHET_MAX_KEYS_PER_TENANT="3")
    return 3


def test_a_tenant_holds_at_most_its_cap_of_live_keys(
    client: TestClient, admin: TenantHandle, key_cap: int
) -> None:
    made = [create(client, admin, name=f"k{n}") for n in range(key_cap - 1)]  # and the admin's

    body = assert_problem(client.post("/v1/keys", json={}, headers=admin.headers), 409)

    assert "RATCHET_MAX_KEYS_PER_TENANT" in body["detail"]
    assert key_count(admin.id) == key_cap
    # A rotation replaces a key: it is not refused at the cap.
    rotated = client.post(f"/v1/keys/{made[0]['id']}/rotate", headers=admin.headers)
    assert rotated.status_code == 201, rotated.text
    # Revoked and expired keys do not count: each frees a place.
    client.post(f"/v1/keys/{made[1]['id']}/revoke", headers=admin.headers).raise_for_status()
    fresh = create(client, admin, expires_in_seconds=60)
    assert_problem(client.post("/v1/keys", json={}, headers=admin.headers), 409)
    set_key_column(fresh["id"], expires_at=datetime.now(UTC) - timedelta(seconds=1))
    create(client, admin)


def test_tasks_approve_is_a_known_scope(client: TestClient, admin: TenantHandle) -> None:
    created = create(client, admin, scopes=["tasks:approve"])

    assert created["scopes"] == ["tasks:approve"]


@pytest.fixture
def tenant_limits(
    configure: Configure, make_tenant: Callable[..., TenantHandle]
) -> tuple[TenantHandle, TenantHandle]:
    """Two admin tenants, each with rate limits of its own."""
    alice, bob = make_tenant(("admin",)), make_tenant(("admin",))
    limits = {"tenants": {alice.name: {"requests": 5, "submissions": 7}, bob.name: {"requests": 9}}}
    configure(RATCHET_RATE_LIMITS=json.dumps(limits))
    return alice, bob


def test_the_fleet_view_needs_the_operator_scope(
    client: TestClient,
    make_tenant: Callable[..., TenantHandle],
    tenant_limits: tuple[TenantHandle, TenantHandle],
) -> None:
    alice, bob = tenant_limits
    operator = make_tenant(("operator",))

    assert_problem(client.get("/v1/admin/ratelimits", headers=alice.headers), 403)
    fleet = client.get("/v1/admin/ratelimits", headers=operator.headers)

    assert fleet.status_code == 200, fleet.text
    scopes = {b["scope"] for b in fleet.json()["buckets"]}
    assert {f"tenant:{alice.name}:requests", f"tenant:{bob.name}:requests"} <= scopes


def test_a_tenant_admin_sees_only_its_own_buckets(
    client: TestClient,
    tenant: TenantHandle,
    tenant_limits: tuple[TenantHandle, TenantHandle],
) -> None:
    alice, bob = tenant_limits

    own = client.get("/v1/ratelimits", headers=alice.headers)

    assert own.status_code == 200, own.text
    scopes = {b["scope"] for b in own.json()["buckets"]}
    assert scopes == {f"tenant:{alice.name}:requests", f"tenant:{alice.name}:submissions"}
    assert bob.name not in own.text
    assert_problem(client.get("/v1/ratelimits", headers=tenant.headers), 403)


# --- item 13: strict key parsing --------------------------------------------------------------


@pytest.mark.parametrize("template", ["Bearer  {key}", "Bearer\t{key}", "Bearer {key} {key}"])
def test_only_exactly_bearer_space_key_is_accepted(
    client: TestClient, tenant: TenantHandle, template: str
) -> None:
    header = template.format(key=tenant.key)

    assert_problem(client.get("/v1/tasks", headers={"Authorization": header}), 401)


def test_two_authorization_headers_are_refused(client: TestClient, tenant: TenantHandle) -> None:
    headers = [("Authorization", f"Bearer {tenant.key}")] * 2

    response = client.post("/v1/tasks", json={"input": "hi"}, headers=headers)

    body = assert_problem(response, 400)
    assert "one Authorization header" in body["detail"]
    assert task_count(tenant.id) == 0


QUERY_KEYS = ["api_key={key}", "key={key}", "token={key}", "API_KEY={key}", "apikey={key}"]
# A bare key, and one under a name of its own (cut short, it is still most of the secret).
QUERY_KEYS += ["{key}", "x=1&{key}", "auth={key}", "q={short}"]


@pytest.mark.parametrize("query", QUERY_KEYS)
@pytest.mark.parametrize("path", ["/v1/tasks", "/healthz"])
def test_a_key_in_the_query_string_is_refused(
    client: TestClient, tenant: TenantHandle, query: str, path: str
) -> None:
    sent = query.format(key=tenant.key, short=tenant.key[:24])
    response = client.post(f"{path}?{sent}", json={"input": "hi"}, headers=tenant.headers)

    body = assert_problem(response, 400)
    assert "Authorization" in body["detail"]
    assert tenant.key not in response.text
    assert task_count(tenant.id) == 0


@pytest.fixture
def served(backend_env: dict[str, str]) -> Iterator[str]:
    """The API on uvicorn in a thread, on the test's backend, its access log going to the root
    logger (as it does under ``ratchet api``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        "api.main:create_app", factory=True, lifespan="on", ws="none", log_config=None
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive(), "the API did not start"
        assert time.monotonic() < deadline, "the API did not start within 30 s"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.mark.parametrize("suffix", [b"\xa0", b"\x85", b"x"])
def test_a_key_with_anything_after_it_is_401(
    served: str, tenant: TenantHandle, suffix: bytes
) -> None:
    # Over a real socket: the header's bytes reach the app as sent (latin-1), where
    # str.strip() would have taken \xa0 and \x85 for whitespace.
    header = b"Bearer " + tenant.key.encode() + suffix
    response = httpx.post(
        f"{served}/v1/tasks", json={"input": "hi"}, headers={"Authorization": header}, timeout=10
    )

    assert_problem(response, 401)
    assert task_count(tenant.id) == 0


@pytest.mark.parametrize("query", ["api_key={key}", "apikey={key}", "{key}"])
def test_a_key_in_the_query_string_is_not_logged(
    served: str, tenant: TenantHandle, caplog: pytest.LogCaptureFixture, query: str
) -> None:
    caplog.set_level(logging.INFO, logger="uvicorn.access")
    marker = uuid.uuid4().hex
    sent = query.format(key=tenant.key)

    response = httpx.get(f"{served}/v1/tasks?marker={marker}&{sent}", timeout=10)

    assert response.status_code == 400
    deadline = time.monotonic() + 10  # the access line is written just after the response
    while not any(marker in r.getMessage() for r in caplog.records if r.name == "uvicorn.access"):
        assert time.monotonic() < deadline, "no access log line within 10 s"
        time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("uvicorn")]
    assert all(tenant.key[:16] not in line for line in lines), lines
    assert any("=REDACTED" in line for line in lines), lines
