"""The whole path in one process: submit over the API, run every step, read the result."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from tests.conftest import TenantHandle
from tests.helpers import calculator_script, scripted_task

pytestmark = pytest.mark.backends("postgresql", "sqlite")


def test_submit_run_and_read_back(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    response = client.post(
        "/v1/tasks", json=scripted_task(calculator_script(3)), headers=tenant.headers
    )
    assert response.status_code == 202, response.text
    task = response.json()
    assert response.headers["location"] == f"/v1/tasks/{task['id']}"
    assert task["status"] == "queued"

    assert drive(task["id"]) == "succeeded"

    done = client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()
    assert done["status"] == "succeeded"
    assert done["steps"] == 3
    assert done["result"] == {"output": "done after 2 calculations"}
    assert done["usage"]["input_tokens"] > 0

    steps = client.get(f"/v1/tasks/{task['id']}/steps", headers=tenant.headers).json()["items"]
    assert [s["number"] for s in steps] == [1, 2, 3]
    assert [c["result"] for s in steps for c in s["tool_calls"]] == [7, 14]
    assert all(s["status"] == "completed" for s in steps)
    assert steps[0]["tool_calls"][0]["idempotency_key"] == f"{task['id']}:1-0"
