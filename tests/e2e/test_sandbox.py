"""run_python through a real ``ratchet worker``: code runs in the sandbox, a task's workspace
lasts across its steps and is gone when it ends, and hostile code (the worker's secrets, a
fork bomb, the database's port) gets nothing while the worker carries on.

The hostile cases one by one are in tests/integration/test_sandbox.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import IN_CI, TenantHandle
from tests.e2e.conftest import StackFactory
from tests.e2e.util import wait_all
from tests.helpers import calculator_script, scripted_task, tool_turn

CANARY = "canary-0b9e44d2c6f1"
SANDBOX_UID = 60_000 + os.getpid() % 5_000

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None and not IN_CI,
    reason="the sandbox tests need bubblewrap (apt-get install bubblewrap)",
)


@pytest.fixture
def sandbox_dir() -> Iterator[Path]:
    """A sandbox directory the sandbox's uid can reach, removed afterwards."""
    top = Path(tempfile.mkdtemp(prefix="ratchet-sandbox-", dir="/tmp"))
    top.chmod(0o711)
    yield top / "workspaces"
    shutil.rmtree(top, ignore_errors=True)


def run_code(http: httpx.Client, *codes: str) -> tuple[str, list[dict[str, Any]]]:
    """Submit a task that runs ``codes`` one step each; its id and its calls' results."""
    turns = [tool_turn("run_python", code=code) for code in codes]
    body = scripted_task([*turns, {"content": "done"}], tools=["run_python"])
    response = http.post("/v1/tasks", json=body)
    assert response.status_code == 202, response.text
    task_id = str(response.json()["id"])
    (task,) = wait_all(http, None, [task_id], timeout=60).values()
    assert task["status"] == "succeeded", task
    steps = http.get(f"/v1/tasks/{task_id}/steps").json()["items"]
    calls = [call for step in steps for call in step["tool_calls"]]
    assert [call["status"] for call in calls] == ["succeeded"] * len(codes), calls
    return task_id, [call["result"] for call in calls]


def test_code_runs_sandboxed_in_a_workspace_that_lasts_until_the_task_ends(
    stack: StackFactory, tenant: TenantHandle, sandbox_dir: Path
) -> None:
    fleet = stack(
        workers=1,
        env={
            "RATCHET_SANDBOX_DIR": str(sandbox_dir),
            "RATCHET_SANDBOX_UID": str(SANDBOX_UID),
            "RATCHET_SANDBOX_TIMEOUT_SECONDS": "3",
            "RATCHET_TEST_CANARY": CANARY,
        },
    )
    http = fleet.client(tenant.headers)
    assert "run_python runs code in a bubblewrap sandbox" in fleet.log_text("worker-0")

    task_id, (wrote, read) = run_code(
        http,
        "open('data.csv', 'w').write('a,b\\n1,2\\n'); print(6 * 7)",
        "print(open('data.csv').read().splitlines()[1])",
    )

    assert wrote["stdout"] == "42\n"
    assert wrote["files"] == [{"name": "data.csv", "size": 8}]
    assert read["stdout"] == "1,2\n"
    assert not (sandbox_dir / task_id).exists()

    database_url = fleet.env["RATCHET_DATABASE_URL"]
    _, (environment, bomb, database) = run_code(
        http,
        "import os; print(os.environ, open('/proc/1/environ').read())",
        "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass\n",
        "import socket; socket.create_connection(('127.0.0.1', 5432), timeout=30)",
    )

    assert CANARY not in environment["stdout"]
    assert database_url not in environment["stdout"]
    assert "RATCHET" not in environment["stdout"]
    assert bomb["timed_out"]
    assert "ConnectionRefusedError" in database["stderr"]
    # The worker carries on: the same process runs the next task.
    after = http.post("/v1/tasks", json=scripted_task(calculator_script(2))).json()["id"]
    assert wait_all(http, None, [after], timeout=60)[after]["status"] == "succeeded"
    assert fleet.worker_procs[0].poll() is None


def test_a_worker_without_bubblewrap_says_so_once_and_its_calls_fail_with_the_reason(
    stack: StackFactory, tenant: TenantHandle, sandbox_dir: Path
) -> None:
    fleet = stack(
        workers=1,
        concurrency=2,
        env={
            "RATCHET_SANDBOX_DIR": str(sandbox_dir),
            "RATCHET_SANDBOX_BWRAP": "/nonexistent/bwrap",
        },
    )
    http = fleet.client(tenant.headers)
    reason = "run_python is unavailable: bubblewrap (/nonexistent/bwrap) is not installed"

    body = scripted_task([tool_turn("run_python", code="print(1)"), {"content": "done"}])
    task_id = http.post("/v1/tasks", json=body).json()["id"]
    assert wait_all(http, None, [task_id], timeout=60)[task_id]["status"] == "succeeded"

    (call,) = http.get(f"/v1/tasks/{task_id}/steps").json()["items"][0]["tool_calls"]
    assert call["status"] == "failed"
    assert reason in call["error"]
    assert fleet.log_text("worker-0").count("run_python is unavailable") == 1
