"""With the database refusing connections, every endpoint that needs it is a 503 problem with
Retry-After, and liveness still answers. (Silent databases: tests/e2e/test_database_down.py.)"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.conftest import TenantHandle, _reset_caches
from tests.e2e.conftest import free_port
from tests.integration.test_api import assert_problem

TASK = "00000000-0000-0000-0000-000000000000"
DATABASE_ENDPOINTS = [
    ("POST", "/v1/tasks", {"input": "hello"}),
    ("GET", "/v1/tasks", None),
    ("GET", f"/v1/tasks/{TASK}", None),
    ("GET", f"/v1/tasks/{TASK}/steps", None),
    ("GET", f"/v1/tasks/{TASK}/events", None),
    ("GET", f"/v1/tasks/{TASK}/webhook-deliveries", None),
    ("POST", f"/v1/tasks/{TASK}/cancel", None),
    ("POST", f"/v1/tasks/{TASK}/retry", None),
    ("POST", f"/v1/webhook-deliveries/{TASK}/redeliver", None),
    ("GET", "/v1/agents", None),
]


@pytest.fixture
def refused(service_env: dict[str, str], tenant: TenantHandle) -> Iterator[TestClient]:
    """The API pointed at a port nothing listens on (started without its lifespan, which
    would refuse to start on a database it cannot check)."""
    from api.main import create_app

    saved = os.environ["RATCHET_DATABASE_URL"]
    os.environ["RATCHET_DATABASE_URL"] = f"postgresql://postgres@127.0.0.1:{free_port()}/ratchet"
    _reset_caches()
    try:
        yield TestClient(create_app(), raise_server_exceptions=False)
    finally:
        os.environ["RATCHET_DATABASE_URL"] = saved
        _reset_caches()


@pytest.mark.parametrize(("method", "path", "body"), DATABASE_ENDPOINTS)
def test_a_refused_database_is_a_503_with_retry_after(
    refused: TestClient, tenant: TenantHandle, method: str, path: str, body: object
) -> None:
    response = refused.request(method, path, json=body, headers=tenant.headers)
    problem = assert_problem(response, 503)
    assert problem["type"] == "urn:ratchet:problem:database-unavailable"
    assert int(response.headers["Retry-After"]) > 0


def test_liveness_does_not_need_the_database(refused: TestClient) -> None:
    assert refused.get("/healthz").json() == {"status": "ok"}
    assert_problem(refused.get("/readyz"), 503)
