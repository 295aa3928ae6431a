"""The HTTP API (v1) on each backend (PostgreSQL with Redis, and SQLite): the contract a client
relies on.

Most tests call the app in-process; the concurrency tests start a real uvicorn server, since
only real sockets and threads make requests race each other.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from shared.settings import get_settings
from shared.store.db import transaction
from shared.store.tables import Task, Tenant
from shared.store.tenants import create_key
from tests.conftest import TenantHandle
from tests.helpers import calculator_script, scripted_task, tool_turn

pytestmark = pytest.mark.backends("postgresql", "sqlite")

PROBLEM_JSON = "application/problem+json"


# --- helpers ----------------------------------------------------------------------------------


def task_count(tenant_id: str) -> int:
    """The tenant's rows in the tasks table, read from the database rather than the API."""
    with transaction() as session:
        count = session.scalar(
            select(func.count()).select_from(Task).where(Task.tenant_id == tenant_id)
        )
    assert count is not None
    return count


def assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    """An RFC 9457 problem with the given status; returns its body."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    body = response.json()
    assert body["status"] == status
    for member in ("type", "title", "detail"):
        assert isinstance(body[member], str), body
        assert body[member], body
    return body


def error_fields(body: dict[str, Any]) -> list[str]:
    errors = body.get("errors")
    assert isinstance(errors, list), body
    assert errors, body
    return [e["field"] for e in errors]


def submit(client: TestClient, tenant: TenantHandle, **extra: Any) -> dict[str, Any]:
    body = {"input": "hello", "model": "scripted"} | extra
    response = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert response.status_code == 202, response.text
    task: dict[str, Any] = response.json()
    return task


def list_all(client: TestClient, tenant: TenantHandle, **params: Any) -> list[list[dict[str, Any]]]:
    """Every page of GET /v1/tasks, following ``next_cursor`` to the end."""
    pages: list[list[dict[str, Any]]] = []
    query = dict(params)
    for _ in range(100):
        response = client.get("/v1/tasks", params=query, headers=tenant.headers)
        assert response.status_code == 200, response.text
        page = response.json()
        pages.append(page["items"])
        if page["next_cursor"] is None:
            return pages
        query["cursor"] = page["next_cursor"]
    raise AssertionError("pagination did not end")


def ids_of(pages: list[list[dict[str, Any]]]) -> list[str]:
    return [task["id"] for page in pages for task in page]


# --- a real server, for real concurrency ------------------------------------------------------


def fire_together(
    url: str, send: Callable[[httpx.Client], httpx.Response], *, count: int
) -> list[httpx.Response]:
    """Send ``count`` requests from as many threads, released at the same instant."""
    barrier = threading.Barrier(count)

    def one(_: int) -> httpx.Response:
        with httpx.Client(base_url=url, timeout=20) as http:
            http.get("/healthz").raise_for_status()  # connect before the barrier
            barrier.wait(timeout=10)
            return send(http)

    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(one, range(count)))


# --- idempotency ------------------------------------------------------------------------------


def test_same_key_and_body_sequentially_creates_one_task(
    client: TestClient, tenant: TenantHandle
) -> None:
    body = scripted_task(calculator_script(2), metadata={"order": "A-1"})
    headers = tenant.headers | {"Idempotency-Key": "order-A-1"}

    responses = [client.post("/v1/tasks", json=body, headers=headers) for _ in range(10)]

    assert [r.status_code for r in responses] == [202] * 10, [r.text for r in responses]
    ids = {r.json()["id"] for r in responses}
    assert len(ids) == 1
    (task_id,) = ids
    assert {r.headers["location"] for r in responses} == {f"/v1/tasks/{task_id}"}
    assert task_count(tenant.id) == 1
    assert ids_of(list_all(client, tenant)) == [task_id]


def test_same_key_with_keys_in_another_order_is_the_same_body(
    client: TestClient, tenant: TenantHandle
) -> None:
    headers = tenant.headers | {"Idempotency-Key": "reordered", "Content-Type": "application/json"}
    first = client.post(
        "/v1/tasks", content=b'{"input": "hi", "metadata": {"a": 1, "b": 2}}', headers=headers
    )
    second = client.post(
        "/v1/tasks", content=b'{"metadata": {"b": 2, "a": 1}, "input": "hi"}', headers=headers
    )

    assert first.status_code == second.status_code == 202, (first.text, second.text)
    assert first.json()["id"] == second.json()["id"]
    assert task_count(tenant.id) == 1


def test_same_key_with_a_different_body_is_422(client: TestClient, tenant: TenantHandle) -> None:
    headers = tenant.headers | {"Idempotency-Key": "reused-key"}
    first = client.post("/v1/tasks", json={"input": "first"}, headers=headers)
    assert first.status_code == 202, first.text

    second = client.post("/v1/tasks", json={"input": "second"}, headers=headers)

    body = assert_problem(second, 422)
    assert "Idempotency-Key" in body["detail"]
    assert task_count(tenant.id) == 1
    original = client.get(f"/v1/tasks/{first.json()['id']}", headers=tenant.headers)
    assert original.status_code == 200
    assert original.json()["status"] == "queued"


def test_idempotency_keys_are_scoped_per_tenant(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    alice, bob = make_tenant(), make_tenant()
    body = {"input": "same body"}

    a = client.post("/v1/tasks", json=body, headers=alice.headers | {"Idempotency-Key": "k-1"})
    b = client.post("/v1/tasks", json=body, headers=bob.headers | {"Idempotency-Key": "k-1"})

    assert a.status_code == b.status_code == 202, (a.text, b.text)
    assert a.json()["id"] != b.json()["id"]
    assert task_count(alice.id) == task_count(bob.id) == 1
    assert client.get(f"/v1/tasks/{a.json()['id']}", headers=bob.headers).status_code == 404


def test_idempotency_key_over_255_characters_is_rejected(
    client: TestClient, tenant: TenantHandle
) -> None:
    headers = tenant.headers | {"Idempotency-Key": "k" * 256}

    response = client.post("/v1/tasks", json={"input": "hi"}, headers=headers)

    body = assert_problem(response, 422)
    assert error_fields(body) == ["idempotency-key"]
    assert task_count(tenant.id) == 0


@pytest.mark.parametrize("round_", range(3))
def test_concurrent_duplicates_create_one_task(
    live_url: str, tenant: TenantHandle, round_: int
) -> None:
    body = scripted_task(calculator_script(2))
    headers = tenant.headers | {"Idempotency-Key": f"concurrent-{round_}"}

    responses = fire_together(
        live_url, lambda http: http.post("/v1/tasks", json=body, headers=headers), count=10
    )

    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {202, 409}, [r.text for r in responses]
    assert 202 in statuses
    ids = {r.json()["id"] for r in responses if r.status_code == 202}
    assert len(ids) == 1, ids
    for conflict in (r for r in responses if r.status_code == 409):
        assert_problem(conflict, 409)
    assert task_count(tenant.id) == 1
    with transaction() as session:
        stored = session.scalars(select(Task.id).where(Task.tenant_id == tenant.id)).all()
    assert list(stored) == list(ids)


def test_concurrent_submissions_without_a_key_each_create_a_task(
    live_url: str, tenant: TenantHandle
) -> None:
    responses = fire_together(
        live_url,
        lambda http: http.post("/v1/tasks", json={"input": "hi"}, headers=tenant.headers),
        count=5,
    )

    assert [r.status_code for r in responses] == [202] * 5, [r.text for r in responses]
    assert len({r.json()["id"] for r in responses}) == 5
    assert task_count(tenant.id) == 5


# --- tenant isolation -------------------------------------------------------------------------


def test_another_tenants_task_is_404_everywhere(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    owner, stranger = make_tenant(), make_tenant()
    task_id = submit(client, owner)["id"]

    for method, path in [
        ("GET", f"/v1/tasks/{task_id}"),
        ("GET", f"/v1/tasks/{task_id}/steps"),
        ("POST", f"/v1/tasks/{task_id}/cancel"),
        ("POST", f"/v1/tasks/{task_id}/retry"),
    ]:
        response = client.request(method, path, headers=stranger.headers)
        body = assert_problem(response, 404)
        assert body["title"] == "Not Found", (method, path)

    # The stranger's cancel did nothing to the owner's task.
    still = client.get(f"/v1/tasks/{task_id}", headers=owner.headers).json()
    assert still["status"] == "queued"


def test_a_missing_task_looks_the_same_as_another_tenants(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    owner, stranger = make_tenant(), make_tenant()
    task_id = submit(client, owner)["id"]
    missing = "01900000-0000-7000-8000-000000000000"

    theirs = assert_problem(client.get(f"/v1/tasks/{task_id}", headers=stranger.headers), 404)
    nobodys = assert_problem(client.get(f"/v1/tasks/{missing}", headers=stranger.headers), 404)

    assert theirs["type"] == nobodys["type"]
    assert theirs["title"] == nobodys["title"]


def test_task_list_never_shows_another_tenants_tasks(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    alice, bob = make_tenant(), make_tenant()
    alices = [submit(client, alice)["id"] for _ in range(4)]
    bobs = [submit(client, bob)["id"] for _ in range(3)]

    bob_pages = list_all(client, bob, limit=2)
    alice_pages = list_all(client, alice, limit=2)

    assert [len(p) for p in bob_pages] == [2, 1]
    assert sorted(ids_of(bob_pages)) == sorted(bobs)
    assert sorted(ids_of(alice_pages)) == sorted(alices)
    assert not set(ids_of(list_all(client, bob, status="queued"))) & set(alices)
    assert not set(ids_of(list_all(client, bob, agent="default"))) & set(alices)


# --- authentication and scopes ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/tasks"),
        ("GET", "/v1/tasks"),
        ("GET", "/v1/tasks/01900000-0000-7000-8000-000000000000"),
        ("GET", "/v1/agents"),
    ],
)
def test_no_api_key_is_401_with_a_challenge(client: TestClient, method: str, path: str) -> None:
    response = client.request(method, path, json={"input": "hi"})

    body = assert_problem(response, 401)
    assert response.headers["www-authenticate"].lower().startswith("bearer")
    assert body["title"] == "Unauthorized"


@pytest.mark.parametrize(
    "authorization",
    ["Bearer rk_not-a-real-key", "Bearer ", "Basic dXNlcjpwYXNz", "rk_without_a_scheme"],
)
def test_a_bad_api_key_is_401(client: TestClient, tenant: TenantHandle, authorization: str) -> None:
    response = client.post(
        "/v1/tasks", json={"input": "hi"}, headers={"Authorization": authorization}
    )

    assert_problem(response, 401)
    assert response.headers["www-authenticate"].lower().startswith("bearer")
    assert task_count(tenant.id) == 0


def test_authentication_comes_before_body_parsing(client: TestClient) -> None:
    # An anonymous caller must learn nothing, not even that its JSON is malformed.
    response = client.post(
        "/v1/tasks", content=b'{"input": ', headers={"Content-Type": "application/json"}
    )

    assert_problem(response, 401)
    assert response.headers["www-authenticate"].lower().startswith("bearer")


def test_a_read_only_key_cannot_write(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    reader = make_tenant(scopes=("tasks:read",))

    created = client.post("/v1/tasks", json={"input": "hi"}, headers=reader.headers)

    body = assert_problem(created, 403)
    assert "tasks:write" in body["detail"]
    assert task_count(reader.id) == 0
    # ... while reading works.
    listed = client.get("/v1/tasks", headers=reader.headers)
    assert listed.status_code == 200
    assert listed.json() == {"items": [], "next_cursor": None}
    assert client.get("/v1/agents", headers=reader.headers).status_code == 200


def test_a_read_only_key_cannot_cancel_or_retry(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    writer = make_tenant()
    task_id = submit(client, writer)["id"]
    with transaction() as session:
        tenant_row = session.get(Tenant, writer.id)
        assert tenant_row is not None
        read_key = create_key(session, tenant_row, ("tasks:read",))
    reader = {"Authorization": f"Bearer {read_key}"}

    assert client.get(f"/v1/tasks/{task_id}", headers=reader).status_code == 200
    assert_problem(client.post(f"/v1/tasks/{task_id}/cancel", headers=reader), 403)
    assert_problem(client.post(f"/v1/tasks/{task_id}/retry", headers=reader), 403)
    assert client.get(f"/v1/tasks/{task_id}", headers=reader).json()["status"] == "queued"


def test_a_write_only_key_cannot_read(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    writer = make_tenant(scopes=("tasks:write",))

    assert_problem(client.get("/v1/tasks", headers=writer.headers), 403)
    assert client.post("/v1/tasks", json={"input": "hi"}, headers=writer.headers).status_code == 202


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param({"model": "scripted"}, "input", id="missing-input"),
        pytest.param({"input": 42}, "input", id="input-not-text-or-messages"),
        pytest.param({"input": ""}, "input", id="input-empty"),
        pytest.param(
            {"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", id="message-role"
        ),
        pytest.param({"input": "hi", "colour": "red"}, "colour", id="unknown-top-level-field"),
        pytest.param({"input": "hi", "max_steps": 0}, "max_steps", id="max-steps-zero"),
        pytest.param({"input": "hi", "agent": "nope"}, "agent", id="unknown-agent"),
        pytest.param({"input": "hi", "tools": ["nope"]}, "tools[0]", id="unknown-tool"),
        pytest.param(
            {"input": "hi", "tools": ["calculator", "nope"]}, "tools[1]", id="second-tool-unknown"
        ),
        pytest.param({"input": "hi", "model": "nope:x"}, "model", id="unknown-provider"),
        pytest.param({"input": "hi", "model": "openai"}, "model", id="provider-without-model"),
        pytest.param(
            scripted_task([{"error": "bogus"}]),
            "model_options.script[0].error",
            id="scripted-bad-error",
        ),
        pytest.param(
            scripted_task([{"content": "ok"}, {"tool_calls": "calculator"}]),
            "model_options.script[1].tool_calls",
            id="scripted-bad-tool-calls",
        ),
        pytest.param(
            {"input": "hi", "metadata": {"customer": {"id": 42}}},
            "metadata.customer",
            id="metadata-nested-object",
        ),
        pytest.param(
            {"input": "hi", "budget": {"max_tokens": -1}}, "budget.max_tokens", id="budget"
        ),
        pytest.param(
            {"input": "hi", "webhook": {"url": "https://10.0.0.1/hook"}},
            "webhook.url",
            id="webhook-private-address",
        ),
    ],
)
def test_bad_submissions_are_422_naming_the_field(
    client: TestClient, tenant: TenantHandle, body: dict[str, Any], field: str
) -> None:
    response = client.post("/v1/tasks", json=body, headers=tenant.headers)

    problem = assert_problem(response, 422)
    assert field in error_fields(problem), problem
    assert task_count(tenant.id) == 0


def test_errors_point_at_the_field_with_a_json_pointer(
    client: TestClient, tenant: TenantHandle
) -> None:
    schema_error = client.post(
        "/v1/tasks", json={"input": [{"role": "robot", "content": "x"}]}, headers=tenant.headers
    )
    reference_error = client.post(
        "/v1/tasks", json={"input": "hi", "tools": ["calculator", "nope"]}, headers=tenant.headers
    )

    pointers = {e["pointer"] for e in assert_problem(schema_error, 422)["errors"]}
    assert "#/input/0/role" in pointers
    assert assert_problem(reference_error, 422)["errors"][0]["pointer"] == "#/tools/1"
    assert task_count(tenant.id) == 0


def test_max_steps_over_the_limit_is_422(client: TestClient, tenant: TenantHandle) -> None:
    limit = get_settings().max_steps_limit
    at_limit = client.post(
        "/v1/tasks", json={"input": "hi", "max_steps": limit}, headers=tenant.headers
    )
    assert at_limit.status_code == 202, at_limit.text

    response = client.post(
        "/v1/tasks", json={"input": "hi", "max_steps": limit + 1}, headers=tenant.headers
    )

    problem = assert_problem(response, 422)
    assert error_fields(problem) == ["max_steps"]
    assert task_count(tenant.id) == 1


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b'{"input": ', id="truncated"),
        pytest.param(b'{"input": "hi",, }', id="syntax-error"),
        pytest.param(b"[1, 2, 3]", id="not-an-object"),
        pytest.param(b"", id="empty"),
    ],
)
def test_a_body_that_is_not_a_json_object_is_rejected(
    client: TestClient, tenant: TenantHandle, content: bytes
) -> None:
    headers = tenant.headers | {"Content-Type": "application/json"}

    response = client.post("/v1/tasks", content=content, headers=headers)

    assert response.status_code in (400, 422), response.text
    problem = assert_problem(response, response.status_code)
    # The failure is the body's as a whole: no member of it is to blame.
    assert error_fields(problem) == ["(body)"], problem
    assert task_count(tenant.id) == 0


def _oversized_body() -> bytes:
    limit = get_settings().max_request_bytes
    return json.dumps({"input": "x" * (limit + 1)}).encode()


def test_an_oversized_body_with_content_length_is_413(
    client: TestClient, tenant: TenantHandle
) -> None:
    headers = tenant.headers | {"Content-Type": "application/json"}

    response = client.post("/v1/tasks", content=_oversized_body(), headers=headers)

    problem = assert_problem(response, 413)
    assert str(get_settings().max_request_bytes) in problem["detail"]
    assert task_count(tenant.id) == 0


def _chunks(data: bytes, size: int = 64 * 1024) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_an_oversized_chunked_body_is_413(client: TestClient, tenant: TenantHandle) -> None:
    headers = tenant.headers | {"Content-Type": "application/json"}

    # A generator body goes out with Transfer-Encoding: chunked and no Content-Length.
    response = client.post("/v1/tasks", content=_chunks(_oversized_body()), headers=headers)

    assert_problem(response, 413)
    assert task_count(tenant.id) == 0


def test_an_oversized_chunked_body_is_413_over_a_real_socket(
    live_url: str, tenant: TenantHandle
) -> None:
    headers = tenant.headers | {"Content-Type": "application/json"}

    with httpx.Client(base_url=live_url, timeout=20) as http:
        response = http.post("/v1/tasks", content=_chunks(_oversized_body()), headers=headers)

    assert response.request.headers.get("transfer-encoding") == "chunked"
    assert_problem(response, 413)
    assert task_count(tenant.id) == 0


def test_a_body_just_under_the_limit_is_read(client: TestClient, tenant: TenantHandle) -> None:
    # Big enough to be streamed in several pieces, small enough to pass both limits.
    body = {"input": "x" * 150_000}
    headers = tenant.headers | {"Content-Type": "application/json"}

    response = client.post("/v1/tasks", content=_chunks(json.dumps(body).encode()), headers=headers)

    assert response.status_code == 202, response.text
    assert task_count(tenant.id) == 1


# --- listing tasks ----------------------------------------------------------------------------


def test_keyset_pagination_returns_every_task_once_newest_first(
    client: TestClient, tenant: TenantHandle
) -> None:
    created = []
    for n in range(7):
        created.append(submit(client, tenant, metadata={"n": n})["id"])
        time.sleep(0.002)  # ids order by creation time at millisecond resolution

    pages = list_all(client, tenant, limit=3)

    assert [len(p) for p in pages] == [3, 3, 1]
    assert ids_of(pages) == list(reversed(created))
    stamps = [datetime.fromisoformat(task["created_at"]) for page in pages for task in page]
    assert stamps == sorted(stamps, reverse=True)
    assert [task["metadata"]["n"] for page in pages for task in page] == list(range(6, -1, -1))


def test_an_exact_multiple_of_the_page_size_ends_without_an_empty_page(
    client: TestClient, tenant: TenantHandle
) -> None:
    created = [submit(client, tenant)["id"] for _ in range(4)]

    pages = list_all(client, tenant, limit=2)

    assert [len(p) for p in pages] == [2, 2]
    assert sorted(ids_of(pages)) == sorted(created)


def test_list_filters_by_status_and_agent(client: TestClient, tenant: TenantHandle) -> None:
    created = [submit(client, tenant)["id"] for _ in range(5)]
    cancelled = created[1:3]
    for task_id in cancelled:
        assert client.post(f"/v1/tasks/{task_id}/cancel", headers=tenant.headers).status_code == 202

    by_status = {
        status: ids_of(list_all(client, tenant, status=status, limit=2))
        for status in ("queued", "cancelled", "succeeded")
    }

    assert sorted(by_status["cancelled"]) == sorted(cancelled)
    assert sorted(by_status["queued"]) == sorted(set(created) - set(cancelled))
    assert by_status["succeeded"] == []
    assert sorted(ids_of(list_all(client, tenant, agent="default"))) == sorted(created)
    assert ids_of(list_all(client, tenant, agent="no-such-agent")) == []
    both = ids_of(list_all(client, tenant, agent="default", status="cancelled"))
    assert sorted(both) == sorted(cancelled)


@pytest.mark.parametrize(
    "cursor",
    [
        pytest.param("garbage", id="not-base64-text"),
        pytest.param("!!!!", id="not-base64"),
        pytest.param("Zm9v", id="base64-of-foo"),
        pytest.param("x" * 201, id="too-long"),
    ],
)
def test_a_garbage_cursor_is_422(client: TestClient, tenant: TenantHandle, cursor: str) -> None:
    submit(client, tenant)

    response = client.get("/v1/tasks", params={"cursor": cursor}, headers=tenant.headers)

    problem = assert_problem(response, 422)
    assert error_fields(problem) == ["cursor"]


def test_an_unknown_status_filter_is_422(client: TestClient, tenant: TenantHandle) -> None:
    response = client.get("/v1/tasks", params={"status": "finished"}, headers=tenant.headers)

    problem = assert_problem(response, 422)
    assert error_fields(problem) == ["status"]


@pytest.mark.parametrize("limit", [0, 201, "ten"])
def test_a_bad_limit_is_422(client: TestClient, tenant: TenantHandle, limit: object) -> None:
    response = client.get("/v1/tasks", params={"limit": limit}, headers=tenant.headers)

    problem = assert_problem(response, 422)
    assert error_fields(problem) == ["limit"]


# --- the step timeline ------------------------------------------------------------------------


TIMELINE_SCRIPT = [
    {
        "tool_calls": [
            {"name": "calculator", "arguments": {"expression": "6*7"}},
            {"name": "current_time", "arguments": {"timezone": "UTC"}},
        ],
        "usage": {"input_tokens": 100, "output_tokens": 10},
    },
    tool_turn("calculator", expression="1/0")
    | {"usage": {"input_tokens": 150, "output_tokens": 7}},
    {"content": "The answer is 42.", "usage": {"input_tokens": 200, "output_tokens": 5}},
]


def test_steps_show_every_model_call_and_tool_call(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    task_id = submit(client, tenant, model_options={"script": TIMELINE_SCRIPT})["id"]
    assert drive(task_id) == "succeeded"

    response = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers)

    assert response.status_code == 200, response.text
    timeline = response.json()
    assert timeline["next_cursor"] is None
    first, second, third = timeline["items"]
    assert [s["number"] for s in (first, second, third)] == [1, 2, 3]
    assert all(s["status"] == "completed" for s in (first, second, third))

    # Model calls: what the model said, and what it cost.
    assert [c["name"] for c in first["model"]["tool_calls"]] == ["calculator", "current_time"]
    assert third["model"]["content"] == "The answer is 42."
    assert third["model"]["tool_calls"] == []
    assert [s["usage"]["input_tokens"] for s in (first, second, third)] == [100, 150, 200]
    assert [s["usage"]["output_tokens"] for s in (first, second, third)] == [10, 7, 5]
    for step in (first, second, third):
        assert step["model_latency_ms"] >= 0
        started, answered, completed = (
            datetime.fromisoformat(step[k])
            for k in ("started_at", "model_completed_at", "completed_at")
        )
        assert started <= answered <= completed

    # Tool calls: arguments, results, status, and the idempotency key the tool saw.
    calc, clock = first["tool_calls"]
    assert (calc["name"], calc["arguments"], calc["status"]) == (
        "calculator",
        {"expression": "6*7"},
        "succeeded",
    )
    assert calc["result"] == 42
    assert calc["error"] is None
    assert calc["idempotency_key"] == f"{task_id}:{calc['call_id']}"
    assert calc["runs"] == 1
    assert calc["finished_at"] is not None
    assert (clock["name"], clock["arguments"], clock["status"]) == (
        "current_time",
        {"timezone": "UTC"},
        "succeeded",
    )
    assert datetime.fromisoformat(clock["result"]).utcoffset() == timedelta(0)
    assert calc["call_id"] != clock["call_id"]

    (failed,) = second["tool_calls"]
    assert (failed["name"], failed["arguments"], failed["status"]) == (
        "calculator",
        {"expression": "1/0"},
        "failed",
    )
    assert failed["error"]
    assert third["tool_calls"] == []

    task = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    assert task["steps"] == 3
    assert task["usage"]["input_tokens"] == 450
    assert task["usage"]["output_tokens"] == 22


def test_steps_paginate_one_at_a_time(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    task_id = submit(client, tenant, model_options={"script": calculator_script(3)})["id"]
    assert drive(task_id) == "succeeded"

    numbers, results, cursor = [], [], None
    for _ in range(10):
        params: dict[str, Any] = {"limit": 1} | ({"cursor": cursor} if cursor else {})
        response = client.get(f"/v1/tasks/{task_id}/steps", params=params, headers=tenant.headers)
        assert response.status_code == 200, response.text
        page = response.json()
        assert len(page["items"]) == 1
        numbers.append(page["items"][0]["number"])
        results.extend(c["result"] for c in page["items"][0]["tool_calls"])
        cursor = page["next_cursor"]
        if cursor is None:
            break

    assert numbers == [1, 2, 3]
    assert results == [7, 14]


def test_steps_of_a_queued_task_are_empty(client: TestClient, tenant: TenantHandle) -> None:
    task_id = submit(client, tenant)["id"]

    response = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers)

    assert response.status_code == 200
    timeline = response.json()
    assert timeline["items"] == []
    assert timeline["next_cursor"] is None


@pytest.mark.parametrize("cursor", ["garbage", "!!!!", "Zm9v"])
def test_a_garbage_steps_cursor_is_422(
    client: TestClient, tenant: TenantHandle, cursor: str
) -> None:
    task_id = submit(client, tenant)["id"]

    response = client.get(
        f"/v1/tasks/{task_id}/steps", params={"cursor": cursor}, headers=tenant.headers
    )

    assert error_fields(assert_problem(response, 422)) == ["cursor"]


# --- agents -----------------------------------------------------------------------------------


def test_agents_lists_default_with_its_tools_and_schemas(
    client: TestClient, tenant: TenantHandle
) -> None:
    response = client.get("/v1/agents", headers=tenant.headers)

    assert response.status_code == 200, response.text
    agents = {a["name"]: a for a in response.json()["items"]}
    default = agents["default"]
    tools = {t["name"]: t for t in default["tools"]}
    assert set(tools) == {
        "calculator",
        "current_time",
        "sleep",
        "http_request",
        "ask_user",
        "run_python",
    }
    for tool in tools.values():
        assert tool["description"]
        assert tool["parameters"]["type"] == "object"
        assert isinstance(tool["idempotent"], bool)
        assert isinstance(tool["requires_approval"], bool)
    calculator = tools["calculator"]["parameters"]
    assert calculator["required"] == ["expression"]
    assert calculator["properties"]["expression"]["type"] == "string"
    assert tools["sleep"]["parameters"]["properties"]["seconds"]["type"] == "number"
    assert "timezone" in tools["current_time"]["parameters"]["properties"]
    http_params = tools["http_request"]["parameters"]
    assert "url" in http_params["required"]
    assert "context" not in http_params["properties"]  # runtime context is not the model's
    assert set(http_params["properties"]["method"]["enum"]) >= {"GET", "POST"}


def test_agents_rejects_a_garbage_cursor(client: TestClient, tenant: TenantHandle) -> None:
    response = client.get("/v1/agents", params={"cursor": "garbage"}, headers=tenant.headers)

    assert error_fields(assert_problem(response, 422)) == ["cursor"]


# --- cancel and retry -------------------------------------------------------------------------


def test_cancel_a_queued_task_then_again(client: TestClient, tenant: TenantHandle) -> None:
    task_id = submit(client, tenant)["id"]

    cancelled = client.post(f"/v1/tasks/{task_id}/cancel", headers=tenant.headers)

    assert cancelled.status_code == 202, cancelled.text
    assert cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["finished_at"] is not None
    read = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    assert read["status"] == "cancelled"
    assert read["error"]["type"] == "cancelled"

    again = client.post(f"/v1/tasks/{task_id}/cancel", headers=tenant.headers)

    assert "cancelled" in assert_problem(again, 409)["detail"]
    assert client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json() == read


def test_a_cancelled_task_never_runs(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    task_id = submit(client, tenant, model_options={"script": calculator_script(2)})["id"]
    assert client.post(f"/v1/tasks/{task_id}/cancel", headers=tenant.headers).status_code == 202

    assert drive(task_id) == "cancelled"

    steps = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()
    assert steps["items"] == []


def test_cancel_a_finished_task_is_409(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    task_id = submit(client, tenant, model_options={"script": calculator_script(1)})["id"]
    assert drive(task_id) == "succeeded"

    assert_problem(client.post(f"/v1/tasks/{task_id}/cancel", headers=tenant.headers), 409)
    assert client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()["status"] == (
        "succeeded"
    )


def test_retry_of_a_task_that_has_not_failed_is_409(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    queued = submit(client, tenant)["id"]
    succeeded = submit(client, tenant, model_options={"script": calculator_script(1)})["id"]
    assert drive(succeeded) == "succeeded"
    cancelled = submit(client, tenant)["id"]
    assert client.post(f"/v1/tasks/{cancelled}/cancel", headers=tenant.headers).status_code == 202

    for task_id, status in [(queued, "queued"), (succeeded, "succeeded"), (cancelled, "cancelled")]:
        response = client.post(f"/v1/tasks/{task_id}/retry", headers=tenant.headers)
        assert status in assert_problem(response, 409)["detail"]
        after = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
        assert after["status"] == status


def test_retry_of_a_failed_task_requeues_it_from_its_last_step(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    task_id = submit(client, tenant, max_steps=1, model_options={"script": calculator_script(3)})[
        "id"
    ]
    assert drive(task_id) == "failed"
    failed = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    assert failed["error"]["type"] == "max_steps_exceeded"
    assert failed["steps"] == 1

    response = client.post(f"/v1/tasks/{task_id}/retry", headers=tenant.headers)

    assert response.status_code == 202, response.text
    retried = response.json()
    assert retried["status"] == "queued"
    assert retried["error"] is None
    assert retried["finished_at"] is None
    assert retried["steps"] == 1  # resumes after the committed step, not from scratch
    assert client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()["status"] == "queued"


# --- health and the API description -----------------------------------------------------------


def test_healthz(client: TestClient) -> None:
    response = client.get("/healthz")

    assert response.status_code == 200
    assert response.json()["status"] == "ok"


def test_readyz_checks_the_database_and_redis(client: TestClient, backend: str) -> None:
    response = client.get("/readyz")

    # On SQLite the queue and the wake-ups are in-process, as in `ratchet dev`: no Redis to ask.
    checks = {"database": "ok"} | ({"redis": "ok"} if backend == "postgresql" else {})
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "ok", "checks": checks}


def test_openapi_describes_the_v1_api(client: TestClient) -> None:
    response = client.get("/openapi.json")

    assert response.status_code == 200
    spec = response.json()
    assert spec["openapi"].startswith("3.")
    assert spec["info"]["title"] == "Ratchet"
    paths = spec["paths"]
    assert {"post", "get"} <= set(paths["/v1/tasks"])
    for path in (
        "/v1/tasks/{task_id}",
        "/v1/tasks/{task_id}/cancel",
        "/v1/tasks/{task_id}/retry",
        "/v1/tasks/{task_id}/steps",
        "/v1/agents",
        "/healthz",
        "/readyz",
    ):
        assert path in paths, path
    assert "202" in paths["/v1/tasks"]["post"]["responses"]
    assert "TaskCreate" in spec["components"]["schemas"]


def test_docs_serve_html(client: TestClient) -> None:
    response = client.get("/docs")

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert "/openapi.json" in response.text


def test_an_unknown_path_is_a_problem(client: TestClient) -> None:
    assert_problem(client.get("/v1/nothing-here"), 404)


def test_a_model_that_keeps_failing_leaves_its_attempts_in_the_timeline(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    script = [{"content": "never", "error": "server_error", "times": 99}]
    task_id = submit(client, tenant, model_options={"script": script})["id"]

    assert drive(task_id) == "failed"

    timeline = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()
    assert timeline["items"] == []  # the model never answered …
    failed = timeline["failed_model_calls"]  # … and each try says how it went
    assert len(failed) == get_settings().model_max_attempts, failed
    for call in failed:
        assert call["error"]["type"] == "model_unavailable", call
        assert call["latency_ms"] >= 0
        assert datetime.fromisoformat(call["started_at"]) is not None
    task = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    assert len(task["error"]["attempts"]) == len(failed)
