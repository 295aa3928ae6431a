"""What a newcomer meets on a first production setup, over HTTP: a refusal says what to do
next. A task that names no model, where the default is one the server cannot call, is told
to name one or to set the default; a key that cannot open the dashboard is told which scope
it needs and the command that makes such a key."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from tests.conftest import Configure, TenantHandle
from tests.integration.test_api import assert_problem, task_count


@pytest.fixture
def scripted_off(configure: Configure) -> None:
    """A production server: the scripted model off, RATCHET_DEFAULT_MODEL not set."""
    configure(RATCHET_SCRIPTED_MODEL="false", RATCHET_DEFAULT_MODEL=None)


@pytest.mark.usefixtures("scripted_off")
def test_a_task_without_a_model_is_told_to_name_one_or_set_the_default(
    client: TestClient, tenant: TenantHandle
) -> None:
    problem = assert_problem(
        client.post("/v1/tasks", json={"input": "hi"}, headers=tenant.headers), 422
    )

    [error] = problem["errors"]
    assert error["field"] == "model"
    assert "names no model" in error["detail"]
    assert "`model`" in error["detail"]
    assert "RATCHET_DEFAULT_MODEL" in error["detail"]
    assert "RATCHET_SCRIPTED_MODEL" in error["detail"]  # and why the default is unavailable
    assert task_count(tenant.id) == 0


@pytest.mark.usefixtures("scripted_off")
def test_a_task_that_names_the_unavailable_model_is_told_only_that(
    client: TestClient, tenant: TenantHandle
) -> None:
    body = {"input": "hi", "model": "scripted"}
    problem = assert_problem(client.post("/v1/tasks", json=body, headers=tenant.headers), 422)

    [error] = problem["errors"]
    assert error["field"] == "model"
    assert "RATCHET_SCRIPTED_MODEL" in error["detail"]
    assert "RATCHET_DEFAULT_MODEL" not in error["detail"]  # it chose its model


def test_a_key_that_cannot_open_the_dashboard_is_told_how_to_get_one_that_can(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    first_key = make_tenant(("tasks:read", "tasks:write", "tasks:approve"))

    answer = client.post("/dashboard/login", data={"key": first_key.key}, follow_redirects=False)

    assert answer.status_code == 401
    assert "admin scope" in answer.text
    assert f"ratchet keys create --tenant {first_key.name} --scope admin" in answer.text
