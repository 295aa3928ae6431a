"""A tool result that JSON (or PostgreSQL's ``jsonb``) cannot hold goes back to the model as an
error, its ledger row is settled ``failed``, and the task goes on: on the real store."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from shared.agents.registry import ToolContext, get_registry
from shared.store.db import transaction
from shared.store.tables import Task, ToolCall
from tests.conftest import TenantHandle
from tests.helpers import scripted_task

pytestmark = pytest.mark.backends("postgresql", "sqlite")

# What a tool might return that the store would refuse after the call had run.
UNSTORABLE: dict[str, Any] = {
    "nan": float("nan"),
    "infinity": {"total": float("inf")},
    "big": 10**5000,
    "object": object(),
    "surrogate": ["\ud800"],
    "nul": "a\x00b",  # the last call: past its script the model answers with its result
}


def _unstorable(key: str, context: ToolContext) -> Any:
    return UNSTORABLE[key]


@pytest.fixture
def unstorable_upserts(backend_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``upsert_record`` returns ``UNSTORABLE[key]`` for this test."""
    tools = get_registry().tools
    monkeypatch.setitem(tools, "upsert_record", replace(tools["upsert_record"], func=_unstorable))


def _calls(*calls: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {"tool_calls": [{"name": name, "arguments": arguments} for name, arguments in calls]}


def test_results_json_cannot_hold_go_back_to_the_model_and_the_task_goes_on(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    unstorable_upserts: None,
) -> None:
    script = [
        _calls(
            ("calculator", {"expression": "9**9999"}), ("calculator", {"expression": "1e308*10"})
        ),
        _calls(*(("upsert_record", {"key": key}) for key in UNSTORABLE)),
    ]
    response = client.post(
        "/v1/tasks", json=scripted_task(script, agent="ops"), headers=tenant.headers
    )
    assert response.status_code == 202, response.text
    task_id = response.json()["id"]

    assert drive(task_id) == "succeeded"

    with transaction() as session:
        task = session.get(Task, task_id)
        assert task is not None
        output = (task.result or {})["output"]
        rows = session.scalars(
            select(ToolCall).where(ToolCall.task_id == task_id).order_by(ToolCall.call_id)
        ).all()
    assert len(rows) == 2 + len(UNSTORABLE)
    for row in rows:  # every call settled, none left `started`, each with what went wrong
        assert (row.status, row.result) == ("failed", None), (row.call_id, row.status)
        expected = "cannot evaluate" if row.tool == "calculator" else "JSON cannot hold"
        assert expected in (row.error or ""), row.error
    steps = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()["items"]
    shown = [(c["status"], c["error"]) for step in steps for c in step["tool_calls"]]
    assert shown == [(row.status, row.error) for row in rows]
    # The model read the last call's error as that call's result.
    assert output.startswith("error: upsert_record returned a result that JSON cannot hold")
    assert "NUL" in output
