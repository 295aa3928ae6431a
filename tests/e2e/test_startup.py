"""Starting processes: a bad setting stops ``ratchet api``, ``worker``, ``dev`` and ``migrate``
at once with one line naming it, and ``ratchet dev`` says which database it uses, keeps one
key per database and refuses a busy port before printing anything."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests.conftest import ADMIN_URL, _libpq
from tests.e2e.test_readme_tour import (
    _clean_env,
    _free_port,
    _ratchet_command,
    _stop,
    _wait_until_ready,
)

EXIT_TIMEOUT_SECONDS = 60  # generous: a loaded machine may take a while to import everything
BANNER = re.compile(r"Ratchet is running at \S+ \((?P<database>.*) \+ in-process queue\)")


def run_ratchet(
    args: list[str], env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_ratchet_command(), *args],
        env={**_clean_env(), **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=EXIT_TIMEOUT_SECONDS,
        check=False,
    )


@pytest.mark.parametrize(
    ("command", "env", "named"),
    [
        (["api"], {"RATCHET_RATE_LIMITS": "{bad"}, "RATCHET_RATE_LIMITS"),
        (["worker"], {"RATCHET_RATE_LIMITS_FILE": "missing.toml"}, "RATCHET_RATE_LIMITS_FILE"),
        (
            ["migrate"],
            {"RATCHET_RATE_LIMITS": '{"tenants": {"*": {"requests": -5}}}'},
            "RATCHET_RATE_LIMITS",
        ),
        (
            ["worker"],
            {"RATCHET_CONCURRENCY": '{"pools": {"p": {"models": ["openai:*"]}}}'},
            "RATCHET_CONCURRENCY",
        ),
        (["api"], {"RATCHET_CONCURRENCY_FILE": "missing.toml"}, "RATCHET_CONCURRENCY_FILE"),
        (["dev", "--port", "0"], {"RATCHET_REDIS_URL": "127.0.0.1:6379"}, "RATCHET_REDIS_URL"),
        (["api"], {"RATCHET_DATABASE_URL": "localhost:5432/ratchet"}, "RATCHET_DATABASE_URL"),
        (["dev"], {"RATCHET_DATABASE_URL": "postgresql://u@h:port/db"}, "RATCHET_DATABASE_URL"),
        (["worker"], {"RATCHET_OPENAI_BASE_URL": "localhost:11434"}, "RATCHET_OPENAI_BASE_URL"),
        (["migrate"], {"RATCHET_DEFAULT_MODEL": "gpt-4o"}, "RATCHET_DEFAULT_MODEL"),
        # A typo, and a module of one's own run without PYTHONPATH=. (``tests`` is not
        # importable from the working directory): stopped before "Ratchet is running".
        (["dev", "--port", "0"], {"RATCHET_AGENT_MODULES": "my_agnets"}, "RATCHET_AGENT_MODULES"),
        (["api"], {"RATCHET_AGENT_MODULES": "tests.sample_agents"}, "PYTHONPATH=."),
        (["worker"], {"RATCHET_AGENT_MODULES": "tests.sample_agents"}, "RATCHET_AGENT_MODULES"),
    ],
)
def test_a_bad_setting_stops_the_process_with_one_line(
    tmp_path: Path, command: list[str], env: dict[str, str], named: str
) -> None:
    done = run_ratchet(command, env, tmp_path)

    assert done.returncode != 0, done
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert named in lines[0], lines[0]
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


def test_a_bad_rate_limits_file_is_named_with_its_problem(tmp_path: Path) -> None:
    (tmp_path / "limits.toml").write_text('[models."openai:*"]\nrequests = 0\n')

    done = run_ratchet(["migrate"], {"RATCHET_RATE_LIMITS_FILE": "limits.toml"}, tmp_path)

    assert done.returncode != 0
    [line] = done.stderr.splitlines()
    assert "RATCHET_RATE_LIMITS_FILE" in line
    assert "requests" in line


def test_ratchet_dev_on_a_busy_port_says_so_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]

        done = run_ratchet(["dev", "--port", str(port)], {}, tmp_path)

    assert done.returncode != 0
    [line] = done.stderr.splitlines()
    assert str(port) in line
    assert "Ratchet is running" not in done.stdout
    assert not (tmp_path / ".ratchet").exists()  # nothing was created or migrated


@pytest.fixture
def dev_database() -> Iterator[str]:
    """An empty PostgreSQL database of its own (``ratchet dev`` migrates it), dropped after."""
    name = f"ratchet_dev_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_libpq(ADMIN_URL), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(_libpq(ADMIN_URL), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start_dev(workdir: Path, env: dict[str, str], label: str) -> tuple[str, str]:
    """Start ``ratchet dev`` in ``workdir``, wait until it answers, stop it; return its
    database (from the banner) and its key."""
    stdout, stderr = workdir / f"{label}.out", workdir / f"{label}.err"
    command = [*_ratchet_command(), "dev", "--port", str(_free_port())]
    with stdout.open("wb") as out, stderr.open("wb") as err:
        proc = subprocess.Popen(
            command,
            cwd=workdir,
            env={**_clean_env(), **env},
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    try:
        server = _wait_until_ready(proc, stdout, stderr)
    finally:
        _stop(proc)
    banner = BANNER.search(stdout.read_text())
    assert banner, stdout.read_text()
    return banner["database"], server.key


def test_ratchet_dev_names_its_database_and_keeps_a_key_per_database(
    tmp_path: Path, dev_database: str
) -> None:
    postgres = {"RATCHET_DATABASE_URL": dev_database}

    sqlite_db, sqlite_key = start_dev(tmp_path, {}, "sqlite-1")
    postgres_db, postgres_key = start_dev(tmp_path, postgres, "postgres-1")
    sqlite_again = start_dev(tmp_path, {}, "sqlite-2")
    postgres_again = start_dev(tmp_path, postgres, "postgres-2")

    assert sqlite_db == "embedded: SQLite"
    assert postgres_db.startswith("PostgreSQL ")
    assert postgres_db.endswith(make_url(dev_database).database or "?")
    assert sqlite_again == (sqlite_db, sqlite_key)
    assert postgres_again == (postgres_db, postgres_key)
    assert sqlite_key != postgres_key
    assert os.stat(tmp_path / ".ratchet" / "dev-api-key").st_mode & 0o077 == 0


def test_ratchet_dev_warns_once_when_an_allow_list_turns_the_egress_policy_off(
    tmp_path: Path,
) -> None:
    start_dev(tmp_path, {"RATCHET_WEBHOOK_ALLOWED_HOSTS": "*"}, "open")

    warnings = [
        line for line in (tmp_path / "open.err").read_text().splitlines() if "egress" in line
    ]
    assert len(warnings) == 1, warnings
    assert "the egress policy is off" in warnings[0]
    assert "RATCHET_WEBHOOK_ALLOWED_HOSTS" in warnings[0]


def test_an_agent_module_that_fails_to_import_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken_agents.py").write_text("raise RuntimeError('the tool table is missing')\n")
    env = {"RATCHET_AGENT_MODULES": "broken_agents", "PYTHONPATH": "."}

    done = run_ratchet(["dev", "--port", "0"], env, tmp_path)

    assert done.returncode != 0
    [line] = done.stderr.splitlines()
    assert "RATCHET_AGENT_MODULES" in line
    assert "'broken_agents'" in line
    assert "the tool table is missing" in line
    assert done.stdout == ""


def test_ratchet_api_says_at_start_when_a_task_without_a_model_would_be_refused(
    tmp_path: Path, service_env: dict[str, str]
) -> None:
    """Production with neither RATCHET_DEFAULT_MODEL nor the scripted model: one line at start,
    before the API serves, naming the setting to set; the API still starts."""
    env = {**service_env, "RATCHET_SCRIPTED_MODEL": "false", "RATCHET_LOG_LEVEL": "WARNING"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])  # its RATCHET_AGENT_MODULES
    env.pop("RATCHET_DEFAULT_MODEL", None)
    port = _free_port()
    errors = tmp_path / "api.err"
    with errors.open("wb") as err:
        proc = subprocess.Popen(
            [*_ratchet_command(), "api", "--port", str(port)],
            cwd=tmp_path,
            env={**_clean_env(), **env},
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    try:
        _wait_for_health(proc, port)
    finally:
        _stop(proc)
    warnings = [line for line in errors.read_text().splitlines() if "RATCHET_DEFAULT_MODEL" in line]
    assert len(warnings) == 1, errors.read_text()
    assert "scripted" in warnings[0]
    assert "refused" in warnings[0]


def _wait_for_health(proc: subprocess.Popen[bytes], port: int) -> None:
    import httpx

    deadline = time.monotonic() + EXIT_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"ratchet api exited with {proc.returncode}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    pytest.fail("ratchet api did not answer /healthz")
