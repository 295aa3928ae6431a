"""run_python (DESIGN §8) tried as a hostile model would: every attempt on the worker fails
or is cut off, and the worker runs the next task as before.

Each case is a task of the scripted model whose one call runs the hostile code through the
real step runner, in this process (which holds the worker's environment: the database URL
and a canary secret). The result in the ledger must show the attempt refused; no process of
the run may be left (the code runs as a uid of its own here, so its processes are easy to
find); and a plain task runs after it. A task's workspace lasts from one step to the next and
is gone once the task ends.

Without ``bwrap`` these tests skip locally and fail in CI, which installs it (``.ci/run``).
"""

from __future__ import annotations

import ast
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shared.sandbox import host, workspaces
from tests.conftest import IN_CI, Configure, TenantHandle
from tests.helpers import calculator_script, scripted_task, tool_turn
from tests.integration.test_durability import ledger_rows, submit

ROOT = Path(__file__).resolve().parents[2]
CANARY = "canary-7f3d0c1e9b2a"
# A uid of this run's own (the tests run as root in CI): whatever runs as it is the sandbox's.
SANDBOX_UID = 60_000 + os.getpid() % 5_000
WALL_SECONDS = 3
MAX_OUTPUT_BYTES = 100_000
MAX_FILE_MB = 8
VICTIM = "victim-task"

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None and not IN_CI,
    reason="the sandbox tests need bubblewrap (apt-get install bubblewrap)",
)


@pytest.fixture
def sandbox_dir(configure: Configure) -> Iterator[Path]:
    """A sandbox directory the sandbox's uid can reach (pytest's own temporary directories
    are root's alone), with short limits; removed afterwards."""
    top = Path(tempfile.mkdtemp(prefix="ratchet-sandbox-", dir="/tmp"))
    top.chmod(0o711)
    configure(
        RATCHET_SANDBOX_DIR=str(top / "workspaces"),
        RATCHET_SANDBOX_UID=str(SANDBOX_UID),
        RATCHET_SANDBOX_TIMEOUT_SECONDS=str(WALL_SECONDS),
        RATCHET_SANDBOX_MAX_OUTPUT_BYTES=str(MAX_OUTPUT_BYTES),
        RATCHET_SANDBOX_MAX_FILE_MB=str(MAX_FILE_MB),
        RATCHET_TEST_CANARY=CANARY,
    )
    yield top / "workspaces"
    shutil.rmtree(top, ignore_errors=True)


def run_task(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], *codes: str
) -> tuple[str, list[dict[str, Any]]]:
    """A task that runs each of ``codes`` in turn, one step each; its id and the results."""
    turns = [tool_turn("run_python", code=code) for code in codes]
    body = scripted_task([*turns, {"content": "done"}], tools=["run_python"])
    task_id = submit(client, tenant, body)
    assert drive(task_id) == "succeeded"
    rows = sorted(ledger_rows(task_id), key=lambda row: row.step_number)
    assert [row.status for row in rows] == ["succeeded"] * len(codes), [r.error for r in rows]
    return task_id, [row.result for row in rows]


def sandbox_processes() -> list[int]:
    """Processes (zombies too) whose real uid is the sandbox's."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
        except (OSError, ValueError):
            continue
        uid = next((line.split()[1] for line in status.splitlines() if line.startswith("Uid:")), "")
        if uid == str(SANDBOX_UID):
            found.append(int(entry.name))
    return found


def refused(result: dict[str, Any], *errors: str) -> bool:
    return result["exit_code"] != 0 and any(error in result["stderr"] for error in errors)


# Each case: code a hostile model might send (formatted with what it goes after), and what
# its result must show. Every result is also searched for the worker's secrets.
Check = Callable[[dict[str, Any]], bool]


def refusal(case_id: str, code: str, error: str) -> Any:
    """A case whose code must fail with ``error`` on its stderr."""
    return pytest.param(code, lambda r: refused(r, error), id=case_id)


HOSTILE: list[Any] = [
    pytest.param(
        "import os; print(sorted(os.environ))",
        lambda r: set(ast.literal_eval(r["stdout"])) <= {"PATH", "HOME", "LANG", "PWD"},
        id="worker-environment",
    ),
    pytest.param(
        "import os; print(os.environ.get('RATCHET_DATABASE_URL'))",
        lambda r: r["stdout"] == "None\n",
        id="database-url",
    ),
    pytest.param(
        "print(open('/proc/1/environ').read())",
        lambda r: "RATCHET" not in r["stdout"],
        id="proc-1-environ",
    ),
    pytest.param(
        "import os\n"
        "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "print(len(pids))\n"
        "for p in pids:\n"
        "    for name in ('environ', 'cmdline'):\n"
        "        try: print(open('/proc/' + p + '/' + name).read())\n"
        "        except OSError as e: print(e)\n",
        lambda r: int(r["stdout"].split()[0]) == 1 and "RATCHET" not in r["stdout"],
        id="every-process-visible",
    ),
    refusal(
        "worker-proc-environ",
        "print(open('/proc/{worker_pid}/environ').read())",
        "FileNotFoundError",
    ),
    refusal("kill-the-worker", "import os; os.kill({worker_pid}, 9)", "ProcessLookupError"),
    refusal("root-home", "import os; print(os.listdir('/root'))", "FileNotFoundError"),
    refusal(
        "project-checkout", "print(open('{checkout}/pyproject.toml').read())", "FileNotFoundError"
    ),
    refusal("etc-shadow", "print(open('/etc/shadow').read())", "FileNotFoundError"),
    refusal(
        "other-task-scratch-by-host-path", "print(open('{victim}').read())", "FileNotFoundError"
    ),
    refusal(
        "other-task-scratch-by-relative-path",
        f"print(open('../{VICTIM}/secret.txt').read())",
        "FileNotFoundError",
    ),
    refusal(
        "postgresql-socket",
        "import socket; socket.create_connection(('127.0.0.1', 5432), timeout=30)",
        "ConnectionRefusedError",
    ),
    refusal(
        "redis-socket",
        "import socket; socket.create_connection(('127.0.0.1', 6379), timeout=30)",
        "ConnectionRefusedError",
    ),
    refusal(
        "metadata-address",
        "import socket; socket.create_connection(('169.254.169.254', 80), timeout=30)",
        "Network is unreachable",
    ),
    refusal(
        "postgresql-unix-socket",
        "import socket; s = socket.socket(socket.AF_UNIX)\n"
        "s.connect('/var/run/postgresql/.s.PGSQL.5432')",
        "FileNotFoundError",
    ),
    pytest.param(
        "import socket; print([name for _, name in socket.if_nameindex()])",
        lambda r: r["stdout"] == "['lo']\n",
        id="network-devices",
    ),
    pytest.param(
        "paths = ['/usr/x', '/etc/passwd', '/x', '/dev/x', '../x', '{checkout}/x', '{victim}']\n"
        "for path in paths:\n"
        "    try:\n"
        "        open(path, 'w').write('owned'); print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('refused', path, type(e).__name__)\n",
        lambda r: "wrote" not in r["stdout"] and r["stdout"].count("refused") == 7,
        id="write-outside-scratch",
    ),
    pytest.param(
        "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass\n",
        lambda r: r["timed_out"],
        id="fork-bomb",
    ),
    refusal(
        "memory-bomb",
        "hoard = []\nwhile True: hoard.append(bytearray(50_000_000))\n",
        "MemoryError",
    ),
    pytest.param("while True: pass\n", lambda r: r["timed_out"], id="infinite-loop"),
    pytest.param(
        "import sys; sys.stdout.write('x' * 100_000_000)",
        lambda r: r["truncated"] and len(r["stdout"]) == MAX_OUTPUT_BYTES,
        id="100-mb-of-output",
    ),
    pytest.param(
        "open('big', 'wb').write(b'0' * (64 << 20))",
        lambda r: refused(r, "File too large") and r["files"][0]["size"] <= MAX_FILE_MB << 20,
        id="disk-filler",
    ),
    pytest.param(
        "import subprocess\n"
        "subprocess.Popen(['sleep', '3600'], start_new_session=True)\n"
        "print('left behind')",
        lambda r: r["stdout"] == "left behind\n",
        id="daemon-left-behind",
    ),
]


@pytest.mark.parametrize(("code", "check"), HOSTILE)
def test_hostile_code_fails_or_is_cut_off_and_the_worker_is_unharmed(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    sandbox_dir: Path,
    code: str,
    check: Check,
) -> None:
    victim = workspaces.open_workspace(VICTIM) / "secret.txt"
    victim.write_text(CANARY)
    targets = {"worker_pid": str(os.getpid()), "checkout": str(ROOT), "victim": str(victim)}
    database_url = os.environ["RATCHET_DATABASE_URL"]

    _, (result,) = run_task(client, tenant, drive, code.format(**targets))

    assert check(result), result
    text = result["stdout"] + result["stderr"]
    assert CANARY not in text
    assert database_url not in text
    assert victim.read_text() == CANARY
    assert not (ROOT / "x").exists()
    assert sandbox_processes() == []
    # The worker is unharmed: the next task runs as ever.
    after = submit(client, tenant, scripted_task(calculator_script(1)))
    assert drive(after) == "succeeded"


def test_a_workspace_lasts_across_steps_and_is_gone_when_the_task_ends(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], sandbox_dir: Path
) -> None:
    write = "import os; os.mkdir('notes'); open('notes/a.txt', 'w').write('from step 1')"
    read = "print(open('notes/a.txt').read())"

    task_id, (first, second) = run_task(client, tenant, drive, write, read)

    assert first == {
        "exit_code": 0,
        "stdout": "",
        "stderr": "",
        "timed_out": False,
        "truncated": False,
        "files": [{"name": "notes/a.txt", "size": 11}],
    }
    assert second["stdout"] == "from step 1\n"
    assert not (sandbox_dir / task_id).exists()


def test_the_sweeper_removes_the_workspaces_of_tasks_that_ended_elsewhere(
    client: TestClient, tenant: TenantHandle, sandbox_dir: Path
) -> None:
    from workers import sweeper

    live = submit(client, tenant, scripted_task(calculator_script(1)))
    cancelled = submit(client, tenant, scripted_task(calculator_script(1)))
    assert client.post(f"/v1/tasks/{cancelled}/cancel", headers=tenant.headers).status_code == 202
    for task_id in (live, cancelled, "no-such-task"):
        (workspaces.open_workspace(task_id) / "scratch").write_text("x")

    assert sweeper.sweep_workspaces() == 2

    assert workspaces.present() == [live]


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        pytest.param(
            {"RATCHET_SANDBOX_BWRAP": "/nonexistent/bwrap"},
            "bubblewrap (/nonexistent/bwrap) is not installed on this host",
            id="bwrap-missing",
        ),
        pytest.param(
            {"RATCHET_SANDBOX_BWRAP": "false"},
            "the bubblewrap sandbox does not start on this host",
            id="bwrap-cannot-start",
        ),
        pytest.param({"RATCHET_SANDBOX": "off"}, "run_python is off", id="off"),
    ],
)
def test_without_a_sandbox_the_call_fails_with_the_reason_logged_once(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    configure: Configure,
    caplog: pytest.LogCaptureFixture,
    sandbox_dir: Path,
    settings: dict[str, str],
    reason: str,
) -> None:
    configure(**settings)
    caplog.set_level(logging.INFO, logger="ratchet.sandbox")
    calls = [tool_turn("run_python", code="print(1)")] * 2
    task_id = submit(client, tenant, scripted_task([*calls, {"content": "done"}]))

    assert drive(task_id) == "succeeded"

    rows = ledger_rows(task_id)
    assert [row.status for row in rows] == ["failed", "failed"]
    assert all(reason in (row.error or "") for row in rows), [row.error for row in rows]
    said = [r.getMessage() for r in caplog.records if r.name == "ratchet.sandbox"]
    assert len(said) == 1, said
    assert reason in said[0]


def test_the_unsafe_subprocess_fallback_runs_code_only_when_chosen(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    configure: Configure,
    caplog: pytest.LogCaptureFixture,
    sandbox_dir: Path,
) -> None:
    configure(RATCHET_SANDBOX="unsafe-subprocess")
    caplog.set_level(logging.INFO, logger="ratchet.sandbox")
    code = "import os; open('out.txt', 'w').write('1'); print(sorted(os.environ))"

    _, (result,) = run_task(client, tenant, drive, code)

    assert result["exit_code"] == 0
    assert set(ast.literal_eval(result["stdout"])) <= {"PATH", "HOME", "LANG"}
    assert result["files"] == [{"name": "out.txt", "size": 1}]
    assert host.check().launcher is not None
    (said,) = [r for r in caplog.records if r.name == "ratchet.sandbox"]
    assert said.levelno == logging.WARNING
    assert "not isolated" in said.getMessage()
