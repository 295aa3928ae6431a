"""Which models a server accepts: the scripted one only where it is turned on, with its delays
capped, and a provider only when some worker could reach it. A refused submission is a 422
naming the field and writes nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shared.store.db import transaction
from shared.store.tables import Task
from tests.conftest import Configure, TenantHandle
from tests.helpers import scripted_task
from tests.integration.test_api import assert_problem, task_count


def refused(client: TestClient, tenant: TenantHandle, body: dict[str, Any]) -> dict[str, Any]:
    """The submission's 422 problem's first error, after checking that nothing was written."""
    problem = assert_problem(client.post("/v1/tasks", json=body, headers=tenant.headers), 422)
    assert task_count(tenant.id) == 0
    error: dict[str, Any] = problem["errors"][0]
    return error


def test_the_scripted_model_is_refused_while_it_is_off(
    configure: Configure, client: TestClient, tenant: TenantHandle
) -> None:
    configure(RATCHET_SCRIPTED_MODEL="false")

    named = refused(client, tenant, scripted_task([{"content": "hi"}]))
    by_default = refused(client, tenant, {"input": "hi"})  # RATCHET_DEFAULT_MODEL is scripted

    for error in (named, by_default):
        assert error["field"] == "model"
        assert "RATCHET_SCRIPTED_MODEL" in error["detail"]


def test_a_scripted_delay_over_the_cap_is_refused(
    configure: Configure, client: TestClient, tenant: TenantHandle
) -> None:
    over_default_cap = scripted_task([{"content": "a"}, {"content": "b", "delay_ms": 60_001}])
    assert refused(client, tenant, over_default_cap)["field"] == "model_options.script[1].delay_ms"

    configure(RATCHET_SCRIPTED_MAX_DELAY_MS="1000")
    error = refused(client, tenant, scripted_task([{"content": "slow", "delay_ms": 1001}]))
    assert error["field"] == "model_options.script[0].delay_ms"
    assert "1000" in error["detail"]
    at_cap = scripted_task([{"content": "slow", "delay_ms": 1000}])
    assert client.post("/v1/tasks", json=at_cap, headers=tenant.headers).status_code == 202


def test_a_worker_with_the_scripted_model_off_fails_the_task_cleanly(
    configure: Configure,
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[[str], str],
) -> None:
    body = scripted_task([{"content": "hi"}])
    task_id = client.post("/v1/tasks", json=body, headers=tenant.headers).json()["id"]
    configure(RATCHET_SCRIPTED_MODEL="false")  # as on a worker configured for production

    assert drive(task_id) == "failed"
    with transaction() as session:
        task = session.get(Task, task_id)
        assert task is not None
        assert task.error is not None
        assert task.error["type"] == "model_rejected"
        assert "RATCHET_SCRIPTED_MODEL" in task.error["message"]


def test_a_worker_sleeps_no_longer_than_its_own_cap(
    configure: Configure,
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[[str], str],
) -> None:
    configure(RATCHET_SCRIPTED_MAX_DELAY_MS="600000")
    body = scripted_task([{"content": "slow", "delay_ms": 300_000}])
    task_id = client.post("/v1/tasks", json=body, headers=tenant.headers).json()["id"]
    configure(RATCHET_SCRIPTED_MAX_DELAY_MS="0")  # the worker's cap is lower than the API's was

    started = time.monotonic()
    assert drive(task_id) == "succeeded"
    # Uncapped, the step would sleep 300 s; 60 s is a generous bound for a loaded machine.
    assert time.monotonic() - started < 60


@pytest.mark.parametrize(
    ("model", "settings"),
    [
        ("anthropic:claude-sonnet-4-5", {}),
        ("openai:gpt-4o-mini", {}),
        ("openai:gpt-4o-mini", {"RATCHET_ANTHROPIC_API_KEY": "sk-ant-x"}),
        (
            "anthropic:claude-sonnet-4-5",
            {"RATCHET_OPENAI_API_KEY": "sk-x", "RATCHET_ANTHROPIC_API_KEY": ""},
        ),
    ],
)
def test_a_provider_without_a_key_or_a_base_url_is_refused(
    configure: Configure,
    client: TestClient,
    tenant: TenantHandle,
    model: str,
    settings: dict[str, str],
) -> None:
    configure(**settings)

    error = refused(client, tenant, {"input": "hi", "model": model})

    assert error["field"] == "model"
    assert f"RATCHET_{model.partition(':')[0].upper()}_API_KEY" in error["detail"]


@pytest.mark.parametrize(
    ("model", "settings"),
    [
        ("anthropic:claude-sonnet-4-5", {"RATCHET_ANTHROPIC_API_KEY": "sk-ant-x"}),
        ("openai:gpt-4o-mini", {"RATCHET_OPENAI_API_KEY": "sk-x"}),
        # A local OpenAI-compatible server (vLLM, Ollama) may need no key.
        ("openai:llama3", {"RATCHET_OPENAI_BASE_URL": "http://127.0.0.1:11434/v1"}),
    ],
)
def test_a_configured_provider_is_accepted(
    configure: Configure,
    client: TestClient,
    tenant: TenantHandle,
    model: str,
    settings: dict[str, str],
) -> None:
    configure(**settings)

    body = {"input": "hi", "model": model}
    response = client.post("/v1/tasks", json=body, headers=tenant.headers)

    assert response.status_code == 202, response.text
