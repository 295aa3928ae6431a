"""Bad input never reaches the database: it is a 4xx problem naming the field, and changes nothing.

PostgreSQL stores no NUL character in text or jsonb, JSON has no NaN or Infinity, event
sequence numbers are 32-bit: each of these once came back as a 500 (found by schemathesis).
The same requests are refused the same way on SQLite.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from shared.store.db import transaction
from tests.conftest import TenantHandle
from tests.integration.test_api import assert_problem, error_fields, task_count

pytestmark = pytest.mark.backends("postgresql", "sqlite")

JSON = {"content-type": "application/json"}
DEEP = 1000


def cursor(value: str) -> str:
    return base64.urlsafe_b64encode(value.encode()).decode().rstrip("=")


@pytest.fixture
def app(backend_env: dict[str, str]) -> FastAPI:
    from api.main import create_app

    return create_app()


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    # A 500 comes back as a response, as a client would see it, rather than as an exception.
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


# Raw bodies: NaN, Infinity and \u0000 are what a JSON encoder on the client side would send
# or refuse; these are the bytes on the wire.
BAD_BODIES = {
    "input": ('{"input": "a\\u0000b"}', "input"),
    "message content": ('{"input": [{"role": "user", "content": "a\\u0000"}]}', "input[0].content"),
    "instructions": ('{"input": "x", "instructions": "a\\u0000"}', "instructions"),
    "metadata value": (
        '{"input": "x", "metadata": {"customer": "4\\u00002"}}',
        "metadata.customer",
    ),
    "metadata key": ('{"input": "x", "metadata": {"cu\\u0000st": "42"}}', "metadata.cu\x00st"),
    "model": ('{"input": "x", "model": "openai:gpt\\u0000"}', "model"),
    "model_options value": (
        '{"input": "x", "model_options": {"stop": ["ok", "a\\u0000"]}}',
        "model_options.stop[1]",
    ),
    "model_options key": (
        '{"input": "x", "model_options": {"x\\u0000": 1}}',
        "model_options.x\x00",
    ),
    "NaN in model_options": (
        '{"input": "x", "model_options": {"temperature": NaN}}',
        "model_options.temperature",
    ),
    "Infinity in budget": (
        '{"input": "x", "budget": {"max_cost_usd": Infinity}}',
        "budget.max_cost_usd",
    ),
    "1e400 in metadata": ('{"input": "x", "metadata": {"customer": 1e400}}', "metadata.customer"),
    "-Infinity in metadata": ('{"input": "x", "metadata": {"n": -Infinity}}', "metadata.n"),
    "deep model_options": (
        '{"input": "x", "model_options": {"a": ' + "[" * DEEP + "]" * DEEP + "}}",
        "(body)",
    ),
    "deep body": ("[" * DEEP + "]" * DEEP, "(body)"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_a_bad_submission_is_a_422_naming_the_field_and_stores_nothing(
    client: TestClient, tenant: TenantHandle, case: str
) -> None:
    body, field = BAD_BODIES[case]
    response = client.post("/v1/tasks", content=body.encode(), headers=tenant.headers | JSON)
    problem = assert_problem(response, 422)
    assert field in error_fields(problem), problem
    assert task_count(tenant.id) == 0


def test_finite_numbers_and_plain_text_are_still_accepted(
    client: TestClient, tenant: TenantHandle
) -> None:
    body = {
        "input": "x",
        "model": "scripted",
        "model_options": {"temperature": 0.5, "seed": 7, "stop": ["\n"], "nested": {"a": [None]}},
        "budget": {"max_cost_usd": 1.5},
        "metadata": {"customer": "42", "n": 3, "score": 0.25, "vip": True, "note": None},
    }
    response = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert response.status_code == 202, response.text
    assert response.json()["metadata"] == body["metadata"]


@pytest.fixture
def task_id(client: TestClient, tenant: TenantHandle) -> str:
    response = client.post("/v1/tasks", json={"input": "x"}, headers=tenant.headers)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


BAD_PARAMS = {
    "task id": ("GET", "/v1/tasks/a%00b", "task_id"),
    "task id of steps": ("GET", "/v1/tasks/a%00b/steps", "task_id"),
    "task id of cancel": ("POST", "/v1/tasks/a%00b/cancel", "task_id"),
    "delivery id": ("POST", "/v1/webhook-deliveries/a%00b/redeliver", "delivery_id"),
    "agent filter": ("GET", "/v1/tasks?agent=a%00b", "agent"),
    "steps cursor, a superscript digit": (
        "GET",
        "/v1/tasks/{id}/steps?cursor=" + cursor("²"),
        "cursor",
    ),
    "steps cursor past int4": ("GET", "/v1/tasks/{id}/steps?cursor=" + cursor("9" * 40), "cursor"),
    "deliveries cursor with NUL": (
        "GET",
        "/v1/tasks/{id}/webhook-deliveries?cursor=" + cursor("a\x00"),
        "cursor",
    ),
    "events after past int4": ("GET", "/v1/tasks/{id}/events?after=2147483648", "after"),
}


@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_a_bad_parameter_is_a_422_naming_it(
    client: TestClient, tenant: TenantHandle, task_id: str, case: str
) -> None:
    method, path, field = BAD_PARAMS[case]
    response = client.request(method, path.format(id=task_id), headers=tenant.headers)
    problem = assert_problem(response, 422)
    assert error_fields(problem) == [field]


def test_a_last_event_id_of_non_ascii_digits_is_a_422(
    app: FastAPI, client: TestClient, tenant: TenantHandle, task_id: str
) -> None:
    # The test client re-encodes header values as UTF-8; ASGITransport sends these bytes as
    # they are. b"\xb2" is "²" in Latin-1, as HTTP headers are read: isdigit() passes it.
    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            headers = [*tenant.headers.items(), ("Last-Event-ID", b"\xb2")]
            return await http.get(f"/v1/tasks/{task_id}/events", headers=headers)

    problem = assert_problem(asyncio.run(get()), 422)
    assert error_fields(problem) == ["Last-Event-ID"]


# An expression each database refuses as it runs (SQLite's 1 / 0 is NULL), and its error.
FAILING = {
    "postgresql": ("1 / 0", "division by zero"),
    "sqlite": ("abs(-9223372036854775807 - 1)", "integer overflow"),
}


def test_statement_errors_never_show_their_parameters(
    backend_env: dict[str, str], backend: str
) -> None:
    expression, error = FAILING[backend]
    with pytest.raises(DBAPIError) as raised, transaction() as session:
        session.execute(text(f"SELECT :value, {expression}"), {"value": "secret-4242"})
    assert error in str(raised.value)
    assert "secret-4242" not in str(raised.value)


def test_an_unexpected_error_is_one_short_record_without_request_data(
    app: FastAPI, caplog: pytest.LogCaptureFixture
) -> None:
    def explode(payload: dict[str, Any]) -> None:
        raise RuntimeError(f"cannot handle {payload['secret']}")

    app.add_api_route("/explode", explode, methods=["POST"])
    caplog.set_level(logging.INFO)
    # raise_server_exceptions=True: a re-raise to the server (which logs it again, message
    # and all) would surface here.
    with TestClient(app) as test_client:
        response = test_client.post("/explode", json={"secret": "hunter2"})
    assert_problem(response, 500)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    logged = errors[0].getMessage() + str(errors[0].exc_info or "")
    assert "RuntimeError" in logged
    assert "hunter2" not in logged


# Every route that takes a body, with text no column can hold: a NUL (PostgreSQL stores none
# in text or jsonb) or a lone surrogate (not Unicode: it cannot be encoded to be stored). Each
# once came back as a 500 from every route but POST /v1/tasks. ``{bad}`` is the JSON escape.
CALL = "00000000-0000-0000-0000-000000000000"
SCHEDULE = '"name": "nightly", "cron": "0 3 * * *"'
BODY_ROUTES = {
    "task input": ("POST", "/v1/tasks", '{"input": "a{bad}"}', "input"),
    "task metadata key": (
        "POST",
        "/v1/tasks",
        '{"input": "x", "metadata": {"k{bad}": 1}}',
        "metadata.k",
    ),
    "key name": ("POST", "/v1/keys", '{"name": "ci{bad}"}', "name"),
    "schedule task input": (
        "POST",
        "/v1/schedules",
        "{" + SCHEDULE + ', "task": {"input": "a{bad}"}}',
        "task.input",
    ),
    "schedule task metadata": (
        "POST",
        "/v1/schedules",
        "{" + SCHEDULE + ', "task": {"input": "x", "metadata": {"m": "a{bad}"}}}',
        "task.metadata.m",
    ),
    "approval edit arguments": (
        "POST",
        f"/v1/tasks/{CALL}/approvals/call-1",
        '{"decision": "edit", "arguments": {"expression": "1{bad}"}}',
        "arguments.expression",
    ),
    "pool patterns": (
        "PUT",
        "/v1/admin/concurrency/pools/gpu",
        '{"max_running": 1, "models": ["openai:{bad}"]}',
        "models[0]",
    ),
    "endpoint url": ("POST", "/v1/webhook-endpoints", '{"url": "https://x.test/{bad}"}', "url"),
    "endpoint change": (
        "PATCH",
        f"/v1/webhook-endpoints/{CALL}",
        '{"url": "https://x.test/{bad}"}',
        "url",
    ),
}
BAD_TEXT = {"NUL": "\\u0000", "lone surrogate": "\\ud800", "lone low surrogate": "\\udc00"}


def _holdings(client: TestClient, tenant: TenantHandle) -> tuple[int, int, int]:
    """What the tenant has: tasks, keys and schedules."""
    keys = client.get("/v1/keys", headers=tenant.headers).json()["items"]
    schedules = client.get("/v1/schedules", headers=tenant.headers).json()["items"]
    return task_count(tenant.id), len(keys), len(schedules)


@pytest.mark.parametrize("text", list(BAD_TEXT))
@pytest.mark.parametrize("route", list(BODY_ROUTES))
def test_text_no_column_can_hold_is_a_422_on_every_route_and_changes_nothing(
    client: TestClient, make_tenant: Callable[..., TenantHandle], route: str, text: str
) -> None:
    from shared.store.tenants import OPERATOR, TENANT_SCOPES

    tenant = make_tenant((*TENANT_SCOPES, OPERATOR))
    before = _holdings(client, tenant)
    method, path, body, field = BODY_ROUTES[route]
    raw = body.replace("{bad}", BAD_TEXT[text]).encode()
    response = client.request(method, path, content=raw, headers=tenant.headers | JSON)
    problem = assert_problem(response, 422)
    assert [f.rstrip("\x00\ufffd") for f in error_fields(problem)] == [field], problem
    assert _holdings(client, tenant) == before


def test_a_form_field_with_a_nul_is_a_422(client: TestClient, tenant: TenantHandle) -> None:
    form = {"content-type": "application/x-www-form-urlencoded"}
    response = client.post("/dashboard/login", content=b"key=a%00b", headers=form)
    assert error_fields(assert_problem(response, 422)) == ["key"]


def test_an_escaped_backslash_and_a_surrogate_pair_are_plain_text(
    client: TestClient, tenant: TenantHandle
) -> None:
    # The text "\u0000" (a backslash, then u0000) and an emoji spelled as its two surrogates.
    raw = b'{"input": "\\\\u0000 \\ud83d\\ude00", "metadata": {"k": "\\\\ud800"}}'
    response = client.post("/v1/tasks", content=raw, headers=tenant.headers | JSON)
    assert response.status_code == 202, response.text
    assert response.json()["metadata"] == {"k": "\\ud800"}
