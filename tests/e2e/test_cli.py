"""The ``ratchet`` command, run as a process: one clear line on stderr for every failure, the
key commands, and the task commands over HTTP."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests.conftest import ADMIN_URL, TenantHandle, _libpq
from tests.e2e.conftest import Run, StackFactory, free_port, run_ratchet
from tests.e2e.util import AT_A_TERMINAL


@pytest.fixture
def ratchet(service_env: dict[str, str], tmp_path: Path) -> Run:
    """Run ``python -m ratchet ARGS`` with this run's services, plus ``env`` overrides
    (a value of None removes the variable), away from any .env of the checkout."""

    def run(
        *args: str, env: dict[str, str | None] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return run_ratchet(*args, env={**service_env, **(env or {})}, cwd=tmp_path)

    return run


def assert_one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> str:
    """A failure told in one line on stderr, with no traceback anywhere."""
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# --- item 17: one line, never a traceback -----------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("submit", "-i", "hi"),
        ("tail", "some-task"),
        ("tasks", "get", "some-task"),
        ("tasks", "list"),
        ("tasks", "cancel", "some-task"),
        ("tasks", "retry", "some-task"),
    ],
)
def test_an_api_that_is_down_is_one_line(ratchet: Run, args: Sequence[str]) -> None:
    down = f"http://127.0.0.1:{free_port()}"

    result = ratchet(*args, env={"RATCHET_URL": down, "RATCHET_KEY": "rk_" + "x" * 43})

    assert_one_line_error(result, "cannot reach", down)


def test_a_missing_key_is_one_line(ratchet: Run) -> None:
    assert_one_line_error(ratchet("tasks", "list", env={"RATCHET_KEY": None}), "RATCHET_KEY")


@pytest.mark.parametrize(
    "url", ["postgresql+psycopg://postgres@127.0.0.1:1/nowhere", "not a database url"]
)
@pytest.mark.parametrize(
    "args", [("migrate",), ("tenants", "list"), ("keys", "list", "--tenant", "x")]
)
def test_a_bad_database_url_is_one_line(ratchet: Run, url: str, args: Sequence[str]) -> None:
    result = ratchet(*args, env={"RATCHET_DATABASE_URL": url})

    assert_one_line_error(result, "RATCHET_DATABASE_URL")


@pytest.fixture
def empty_database() -> Iterator[str]:
    name = f"ratchet_empty_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_libpq(ADMIN_URL), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(_libpq(ADMIN_URL), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.parametrize("args", [("tenants", "create", "acme"), ("keys", "list", "--tenant", "x")])
def test_an_unmigrated_database_says_run_migrate_in_one_line(
    ratchet: Run, empty_database: str, args: Sequence[str]
) -> None:
    result = ratchet(*args, env={"RATCHET_DATABASE_URL": empty_database})

    assert_one_line_error(result, "ratchet migrate")


def test_version_comes_from_the_package(ratchet: Run) -> None:
    result = ratchet("--version")

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ratchet {metadata.version('ratchet')}"


# --- item 4: keys and tenants from the CLI ----------------------------------------------------


def test_keys_from_the_cli_create_list_rotate_and_revoke(
    ratchet: Run, make_tenant: Callable[..., TenantHandle]
) -> None:
    from shared.store.db import transaction
    from shared.store.tenants import authenticate

    tenant = make_tenant()

    def usable(key: str) -> bool:
        with transaction() as session:
            return authenticate(session, key) is not None

    created = ratchet(
        "keys", "create", "--tenant", tenant.name, "--scope", "operator", "--name", "ops",
        "--expires-in", "12h",
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert usable(key)
    listed = ratchet("keys", "list", "--tenant", tenant.name)
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    ops = rows["ops"]
    assert ops["scopes"] == ["operator"]
    assert key.startswith(ops["prefix"])
    assert ops["expires_at"] is not None
    assert key not in listed.stdout

    rotated = ratchet("keys", "rotate", ops["id"], "--tenant", tenant.name)
    assert rotated.returncode == 0, rotated.stderr
    new_key = rotated.stdout.strip()
    assert usable(new_key)
    assert not usable(key)
    [new_row] = [r for r in json.loads(ratchet("keys", "list", "--tenant", tenant.name).stdout)
                 if r["name"] == "ops" and r["revoked_at"] is None]  # fmt: skip
    revoked = ratchet("keys", "revoke", new_row["id"], "--tenant", tenant.name)
    assert revoked.returncode == 0, revoked.stderr
    assert not usable(new_key)
    assert tenant.name in {t["name"] for t in json.loads(ratchet("tenants", "list").stdout)}


@pytest.mark.parametrize(
    "args",
    [
        ("--expires-in", "soon"),
        ("--expires-at", "tomorrow"),
        ("--expires-at", "2001-01-01T00:00:00Z"),
        ("--scope", "root"),
    ],
)
def test_a_bad_key_option_is_one_line_and_creates_nothing(
    ratchet: Run, tenant: TenantHandle, args: Sequence[str]
) -> None:
    assert_one_line_error(ratchet("keys", "create", "--tenant", tenant.name, *args))

    assert len(json.loads(ratchet("keys", "list", "--tenant", tenant.name).stdout)) == 1


def test_another_tenants_key_cannot_be_revoked_by_naming_the_wrong_tenant(
    ratchet: Run, make_tenant: Callable[..., TenantHandle]
) -> None:
    alice, bob = make_tenant(), make_tenant()
    [bobs] = json.loads(ratchet("keys", "list", "--tenant", bob.name).stdout)

    assert_one_line_error(ratchet("keys", "revoke", bobs["id"], "--tenant", alice.name))
    [after] = json.loads(ratchet("keys", "list", "--tenant", bob.name).stdout)
    assert after["revoked_at"] is None


# --- item 19: the webhook allow-list the CLI checks with --------------------------------------


def test_add_endpoint_says_which_allow_list_it_checked(ratchet: Run, tenant: TenantHandle) -> None:
    url = "https://127.0.0.1:9/hook"
    args = ("webhooks", "add-endpoint", "--tenant", tenant.name, "--url", url)

    refused = ratchet(*args, env={"RATCHET_WEBHOOK_ALLOWED_HOSTS": None})

    line = assert_one_line_error(refused, "RATCHET_WEBHOOK_ALLOWED_HOSTS", "own environment")
    assert "set it here too" in line
    added = ratchet(*args, env={"RATCHET_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1"})
    assert added.returncode == 0, added.stderr
    assert added.stdout.strip()


# --- item 17: tasks over HTTP -----------------------------------------------------------------


def test_tasks_commands_over_http(ratchet: Run, stack: StackFactory, tenant: TenantHandle) -> None:
    fleet = stack(workers=0)  # no worker: the task stays queued while the commands look at it
    env: dict[str, str | None] = {"RATCHET_URL": fleet.url, "RATCHET_KEY": tenant.key}

    submitted = ratchet("submit", "-i", "hello", "--model", "scripted", env=env)
    assert submitted.returncode == 0, submitted.stderr
    task_id = json.loads(submitted.stdout)["id"]

    got = ratchet("tasks", "get", task_id, env=env)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["status"] == "queued"
    page = json.loads(ratchet("tasks", "list", "--status", "queued", env=env).stdout)
    assert task_id in {t["id"] for t in page["items"]}
    # Retrying a task that has not failed is refused by the API: one line, not a traceback.
    assert_one_line_error(ratchet("tasks", "retry", task_id, env=env), "409")
    cancelled = ratchet("tasks", "cancel", task_id, env=env)
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout)["id"] == task_id
    assert_one_line_error(ratchet("tasks", "get", str(uuid.uuid4()), env=env), "404")


# --- what a newcomer tripped on ---------------------------------------------------------------


def test_a_key_for_a_tenant_that_does_not_exist_says_how_to_create_it(ratchet: Run) -> None:
    name = f"ops-{uuid.uuid4().hex[:6]}"

    result = ratchet("keys", "create", "--tenant", name, "--scope", "operator")

    assert_one_line_error(result, f"no tenant named {name!r}", f"ratchet tenants create {name}")


@pytest.fixture
def missing_database() -> Iterator[str]:
    """The URL of a database its server does not have (yet), dropped after the test."""
    name = f"ratchet_new_{uuid.uuid4().hex[:8]}"
    yield make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(_libpq(ADMIN_URL), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_migrate_creates_a_database_its_server_does_not_have(
    ratchet: Run, missing_database: str
) -> None:
    env: dict[str, str | None] = {"RATCHET_DATABASE_URL": missing_database}

    first = ratchet("migrate", env=env)
    again = ratchet("migrate", env=env)

    assert first.returncode == 0, first.stderr
    assert f"created database {missing_database.rsplit('@', maxsplit=1)[-1]}" in first.stderr
    assert again.returncode == 0, again.stderr
    assert "created" not in again.stderr  # there now: it is only migrated
    created = ratchet("tenants", "create", "acme", env=env)
    assert created.returncode == 0, created.stderr


@pytest.mark.parametrize(
    ("content", "what"),
    [
        (None, "cannot read it"),
        ("{not json", "not JSON"),
        ('{"turns": []}', "'turns'"),
        ('"hello"', "a JSON str"),
    ],
)
def test_a_bad_script_file_is_one_line_naming_the_file(
    ratchet: Run, tmp_path: Path, content: str | None, what: str
) -> None:
    script = tmp_path / "my-script.json"
    if content is not None:
        script.write_text(content)
    env: dict[str, str | None] = {"RATCHET_URL": f"http://127.0.0.1:{free_port()}"}

    result = ratchet("submit", "-i", "hi", "--script", str(script), env={**env, "RATCHET_KEY": "k"})

    assert_one_line_error(result, "--script", str(script), what)


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "localhost:8000", "ftp://example.com"])
def test_a_ratchet_url_without_its_scheme_is_refused_in_one_line(ratchet: Run, url: str) -> None:
    result = ratchet("tasks", "list", env={"RATCHET_URL": url, "RATCHET_KEY": "rk_x"})

    line = assert_one_line_error(result, "RATCHET_URL", repr(url), "http://")
    assert "cannot reach" not in line


def test_schedules_add_help_says_the_sixth_field_is_the_second(ratchet: Run) -> None:
    result = ratchet("schedules", "add", "--help", env={"COLUMNS": "200"})

    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "sixth field, the LAST, for the second" in text
    assert "not every 5 s" in text


def test_schedules_are_checked_by_the_server_not_the_command(
    ratchet: Run, stack: StackFactory, tenant: TenantHandle
) -> None:
    """The server has the scripted model on; the shell running the command does not (nor any
    database setting): the schedule is the server's to check, and it accepts it."""
    fleet = stack(workers=0)
    env: dict[str, str | None] = {
        "RATCHET_URL": fleet.url,
        "RATCHET_KEY": tenant.key,
        "RATCHET_SCRIPTED_MODEL": "false",
        "RATCHET_DATABASE_URL": None,
    }
    task = json.dumps({"input": "hi", "model": "scripted", "model_options": {"script": [{}]}})

    added = ratchet("schedules", "add", "nightly", "--cron", "0 3 * * *", "--task", task, env=env)
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["next_fire_at"] is not None
    paused = ratchet("schedules", "pause", "nightly", env=env)
    assert json.loads(paused.stdout)["paused"] is True
    [listed] = json.loads(ratchet("schedules", "list", env=env).stdout)
    assert (listed["name"], listed["paused"]) == ("nightly", True)
    assert ratchet("schedules", "delete", "nightly", env=env).returncode == 0
    assert json.loads(ratchet("schedules", "list", env=env).stdout) == []
    # What the server refuses is told in one line, as the server said it.
    bad = json.dumps({"input": "hi", "agent": "no-such-agent"})
    refused = ratchet("schedules", "add", "x", "--cron", "0 3 * * *", "--task", bad, env=env)
    assert_one_line_error(refused, "422", "no-such-agent")
    assert_one_line_error(ratchet("schedules", "pause", "nightly", env=env), "no schedule")


def test_schedules_refuse_a_tenant_option_rather_than_ignore_it(ratchet: Run) -> None:
    result = ratchet("schedules", "list", "--tenant", "acme", env={"RATCHET_KEY": "rk_x"})

    assert_one_line_error(result, "RATCHET_KEY", "ratchet keys create --tenant acme")


SUBMIT_AND_WAIT = ("submit", "-i", "hi", "--model", "scripted", "--wait")


def test_ctrl_c_while_submit_waits_leaves_the_task_id_and_how_to_follow_it(
    stack: StackFactory, tenant: TenantHandle, service_env: dict[str, str], tmp_path: Path
) -> None:
    fleet = stack(workers=0)  # no worker: the task waits until the command is interrupted
    env = {**os.environ, **service_env, "RATCHET_URL": fleet.url, "RATCHET_KEY": tenant.key}
    errors = tmp_path / "submit.err"
    with errors.open("wb") as err:
        # With Ctrl-C as at a terminal: a run started in the background ignores SIGINT, and
        # the command, inheriting that, once waited on through it.
        proc = subprocess.Popen(
            [sys.executable, "-c", AT_A_TERMINAL, *SUBMIT_AND_WAIT],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    try:
        task_id = _await_submitted(proc, errors)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    told = errors.read_text()
    assert proc.returncode == 130, told
    assert "Traceback" not in told
    assert f"ratchet tail {task_id}" in told
    with fleet.client(headers=tenant.headers) as http:
        assert http.get(f"/v1/tasks/{task_id}").json()["status"] == "queued"  # it goes on


def _await_submitted(proc: subprocess.Popen[bytes], errors: Path) -> str:
    """The task id ``submit --wait`` puts on stderr once the task is accepted."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"submitted task (\S+);", errors.read_text())
        if found:
            return found.group(1)
        assert proc.poll() is None, errors.read_text()
        time.sleep(0.1)
    pytest.fail(f"no task id on stderr: {errors.read_text()}")
