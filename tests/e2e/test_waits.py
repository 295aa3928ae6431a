"""Durable waits and parked parents against real processes: a task parked on a token holds
no worker thread, lease or slot (the fleet's own counts say so), the wait's signed URL
completes it once, and a kill around the completion loses nothing; a hundred parents parked
on slow children, on a fleet that admits four tasks at once, all finish."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from shared.store.db import transaction
from shared.store.tables import Task
from tests.conftest import TenantHandle
from tests.e2e.conftest import FAST_RECOVERY, Stack, StackFactory
from tests.e2e.util import wait_all
from tests.helpers import scripted_task, tool_turn

# Killed workers leave unacked messages behind.
pytestmark = pytest.mark.usefixtures("forget_unacked")

FAST = {
    **FAST_RECOVERY,
    "RATCHET_APPROVAL_LINK_SECRET": "w" * 40,
    "RATCHET_PUBLIC_URL": "https://ratchet.example",
}
CI = scripted_task([tool_turn("await_ci", run="build-9"), {"content": "CI done"}], agent="lead")


def wait_for(http: httpx.Client, task_id: str, status: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        task = http.get(f"/v1/tasks/{task_id}").json()
        if task["status"] == status:
            return dict(task)
        assert time.monotonic() < deadline, f"task {task_id} never {status}: {task}"
        time.sleep(0.05)


def holdings(fleet: Stack, operator: TenantHandle, task_id: str) -> dict[str, Any]:
    """What the task holds of the fleet, by the fleet's own accounts: steps running in the
    workers (and whether it is one), the tenants' slots in use, and its lease."""
    with fleet.client(headers=operator.headers) as admin:
        workers = admin.get("/v1/admin/fleet").json()["workers"]
        usage = admin.get("/v1/admin/concurrency").json()
    with transaction() as session:
        row = session.get(Task, task_id)
        assert row is not None
        lease = (row.lease_owner, row.lease_expires_ms, row.admitted_ms)
    return {
        "busy": sum(w["busy"] for w in workers),
        "running_it": any(task_id in w["running"] for w in workers),
        "slots": usage["admitted"],  # fleet-wide: only this test's stack runs here
        "lease": lease,
    }


def test_a_parked_task_holds_nothing_and_its_signed_url_completes_it_once(
    stack: StackFactory,
    tenant: TenantHandle,
    make_tenant: Callable[..., TenantHandle],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    journal = tmp_path / "journal"
    journal.touch()
    operator = make_tenant(scopes=("tasks:read", "operator"))
    fleet = stack(workers=1, concurrency=2, env={**FAST, "RATCHET_TEST_JOURNAL": str(journal)})
    with fleet.client(headers=tenant.headers) as http:
        task_id = http.post("/v1/tasks", json=CI).json()["id"]
        task = wait_for(http, task_id, "waiting")
        time.sleep(1.0)  # the fleet's presence is published every few seconds: let it catch up
        held = holdings(fleet, operator, task_id)
        assert held["lease"] == (None, None, None), held
        assert not held["running_it"], held
        assert held["slots"] == 0, held
        (wait,) = task["waiting"]["waits"]
        url = urlsplit(wait["url"])
    with fleet.client() as anyone:  # no key: the signed URL is the authority
        done = anyone.post(f"{url.path}?{url.query}", json={"conclusion": "green"})
        assert done.status_code == 200, done.text
        again = anyone.post(f"{url.path}?{url.query}", json={"conclusion": "red"})
        assert again.status_code == 409, again.text
    with fleet.client(headers=tenant.headers) as http:
        (task,) = wait_all(http, None, [task_id], timeout=60).values()
        assert task["status"] == "succeeded", task
        (step, _) = http.get(f"/v1/tasks/{task_id}/steps").json()["items"]
        (call,) = step["tool_calls"]
    assert (call["result"], call["runs"]) == ({"conclusion": "green"}, 1)
    assert journal.read_text().count("ci ") == 1


@pytest.mark.parametrize("point", ["after_park", "resume_parked"])
def test_kill_around_the_completion_loses_nothing(
    point: str, stack: StackFactory, tenant: TenantHandle, tmp_path: Path
) -> None:
    marker, journal = tmp_path / "killed", tmp_path / "journal"
    journal.touch()
    env = {
        **FAST,
        "RATCHET_TEST_JOURNAL": str(journal),
        "RATCHET_FAILPOINTS": f"{point}=kill_once:{marker}",
    }
    fleet = stack(workers=1, concurrency=2, env=env)
    with fleet.client(headers=tenant.headers) as http:
        task_id = http.post("/v1/tasks", json=CI).json()["id"]
        task = wait_for(http, task_id, "waiting")
        (wait,) = task["waiting"]["waits"]
        done = http.post(f"/v1/waits/{wait['token']}", json={"conclusion": "green"})
        assert done.status_code == 200, done.text
        (task,) = wait_all(http, None, [task_id], timeout=90).values()
        assert task["status"] == "succeeded", task
        (step, _) = http.get(f"/v1/tasks/{task_id}/steps").json()["items"]
        (call,) = step["tool_calls"]
    assert marker.exists(), "no worker reached the failpoint"
    assert call["result"] == {"conclusion": "green"}
    assert journal.read_text().count("ci ") == 1  # the tool that parked never ran again


def test_a_hundred_parents_parked_on_slow_children_all_finish_on_a_narrow_fleet(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    """Four tasks of the tenant at once, a hundred parents: were a parked parent holding its
    slot, the first four would hold them all and no child would ever run."""
    env = {**FAST, "RATCHET_CONCURRENCY": json.dumps({"tenants": {"*": {"max_running": 4}}})}
    fleet = stack(workers=1, concurrency=4, env=env)
    body = scripted_task(
        [tool_turn("napper", task="rest a moment"), {"content": "parent done"}], agent="lead"
    )
    with fleet.client(headers=tenant.headers) as http:
        parents = [http.post("/v1/tasks", json=body).json()["id"] for _ in range(100)]
        finished = wait_all(http, None, parents, timeout=300)
        statuses = {t["status"] for t in finished.values()}
        kids = [http.get(f"/v1/tasks/{p}/children").json()["items"] for p in parents[:10]]
    assert statuses == {"succeeded"}
    assert all(len(k) == 1 and k[0]["status"] == "succeeded" for k in kids)
    with transaction() as session:
        children = session.query(Task).filter(Task.parent_id.in_(parents)).count()
    assert children == 100  # one child per parent's call
