"""Tenant secrets across real processes: set through a real API, read by a tool in a real
worker, and never written to the worker's log (the tool logs it, and raises with it)."""

from __future__ import annotations

from collections.abc import Callable

from shared.vault import new_key
from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory
from tests.e2e.util import wait_all
from tests.helpers import scripted_task, tool_turn

TOKEN = "tok-e2e-5d1f0b9a7c3e4428-not-for-your-eyes"


def test_a_secret_reaches_its_tool_in_a_worker_and_never_its_log(
    stack: StackFactory, make_tenant: Callable[..., TenantHandle]
) -> None:
    admin = make_tenant(("admin",))
    fleet = stack(workers=1, concurrency=2, env={"RATCHET_SECRETS_KEY": new_key()})
    script = [
        tool_turn("use_token"),
        tool_turn("use_token", fail=True),
        {"content": "deployed"},
    ]
    with fleet.client(headers=admin.headers) as http:
        put = http.put("/v1/secrets/DEPLOY_TOKEN", json={"value": TOKEN})
        assert put.status_code == 201, put.text
        body = scripted_task(script, agent="deployer")
        task_id = http.post("/v1/tasks", json=body).json()["id"]
        [task] = wait_all(http, None, [task_id], timeout=60).values()
        steps = http.get(f"/v1/tasks/{task_id}/steps").text
    assert task["status"] == "succeeded"
    assert TOKEN not in steps
    assert "[secret:DEPLOY_TOKEN]" in steps  # the tool was handed the secret, and returned it

    worker_log = fleet.log_text("worker-0")
    assert "deploying with token [secret:DEPLOY_TOKEN]" in worker_log
    assert TOKEN not in worker_log
    assert TOKEN not in fleet.log_text("api")
