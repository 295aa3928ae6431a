"""``kill -9`` of a worker in the middle of an MCP tool call, against real processes: the
worker's stdio MCP server (a child of its prefork process) is waiting in a tool when the whole
worker dies. The ledger's rules hold for MCP tools as for any tool: a non-idempotent call is
not run again (the server counts its calls in a file) and the model is told its outcome is
unknown; an idempotent one (``readOnlyHint``) is run again, with the same idempotency key in
``_meta``. A worker process starts its stdio server once for all its calls, and the orphaned
server of the killed worker exits on its own."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory
from tests.e2e.test_crashes import FAST
from tests.e2e.util import wait_all
from tests.fakes.mcp_servers.toolset import Record
from tests.helpers import scripted_task, tool_turn

ROOT = Path(__file__).resolve().parents[2]
WAIT_SECONDS = 60.0


def wait_for(what: str, ready: object, timeout: float = WAIT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.parametrize(
    ("tool", "runs", "status"),
    [
        ("slow_write", 1, "failed"),  # no annotation: not idempotent, not run again
        ("slow_read", 2, "succeeded"),  # readOnlyHint: idempotent, run again
    ],
)
def test_a_kill_mid_call_follows_the_ledgers_rules(
    stack: StackFactory, tenant: TenantHandle, tmp_path: Path, tool: str, runs: int, status: str
) -> None:
    record = Record(tmp_path)
    servers = {
        "files": {
            "command": sys.executable,
            "args": ["-m", "tests.fakes.mcp_servers.stdio_server"],
            "cwd": str(ROOT),
            "env": {"MCP_FAKE_DIR": str(tmp_path)},
        }
    }
    fleet = stack(
        workers=1, concurrency=1, env={**FAST, "RATCHET_MCP_SERVERS": json.dumps(servers)}
    )
    script = [
        {
            "tool_calls": [
                {"name": "files.echo", "arguments": {"text": "one"}},
                {"name": "files.add", "arguments": {"a": 1, "b": 2}},
            ]
        },
        tool_turn(f"files.{tool}", seconds=WAIT_SECONDS),
        {"content": "done"},
    ]
    with fleet.client(headers=tenant.headers) as http:
        answer = http.post("/v1/tasks", json=scripted_task(script, tools=["files.*"]))
        assert answer.status_code == 202, answer.text
        task_id = answer.json()["id"]
        wait_for(f"the call to {tool}", lambda: len(record.calls(tool)) == 1)
        # Three calls so far, all to the one server this worker process started.
        [server_pid] = record.starts()
        assert {c["pid"] for c in record.calls()} == {server_pid}

        fleet.kill_worker(0)  # SIGKILL to the worker and its prefork child, mid-call
        wait_for("the orphaned stdio server to exit", lambda: not alive(server_pid))
        (tmp_path / "release").touch()  # a call run again ends at once
        fleet.start_worker()
        task = wait_all(http, None, [task_id], timeout=WAIT_SECONDS)[task_id]
        steps = http.get(f"/v1/tasks/{task_id}/steps").json()["items"]

    assert task["status"] == "succeeded", task
    [call] = steps[1]["tool_calls"]
    assert call["server"] == "files"
    assert (call["status"], call["runs"]) == (status, runs), call
    sent = record.calls(tool)
    assert len(sent) == runs  # the server's own count
    assert {c["key"] for c in sent} == {call["idempotency_key"]}
    if status == "failed":
        assert "outcome is unknown" in call["error"]
        assert "not run again" in call["error"]
    # The new worker process started the server once more; the killed one's is gone.
    assert len(record.starts()) == 2
    assert os.getpid() not in record.starts()
