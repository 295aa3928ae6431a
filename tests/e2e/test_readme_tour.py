"""The README keeps its promises: the curl tour runs word for word against ``ratchet dev``,
the configuration reference (docs/reference/configuration.md) names every setting with its
default, and CI runs command 2 as the README gives it.

``ratchet dev`` starts in a temporary working directory (so it makes a fresh SQLite data
directory there) on a free port; the ```sh blocks between ``<!-- tour -->`` and
``<!-- /tour -->`` then run in order in one ``bash -euo pipefail`` with the ``RATCHET_URL``
and ``RATCHET_KEY`` that ``ratchet dev`` printed. No PostgreSQL or Redis is involved.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "reference" / "configuration.md"
START_TIMEOUT_SECONDS = 60.0
TOUR_TIMEOUT_SECONDS = 180.0
EXPORT_LINE = re.compile(r"export RATCHET_URL=(?P<url>\S+) RATCHET_KEY=(?P<key>\S+)")
TOUR = re.compile(r"<!-- tour -->(?P<body>.*?)<!-- /tour -->", re.DOTALL)
SH_BLOCK = re.compile(r"^```sh\n(?P<code>.*?)^```", re.DOTALL | re.MULTILINE)
SETTING_ROW = re.compile(r"^\| `(RATCHET_[A-Z0-9_]+)` \| (.*?) \|", re.MULTILINE)
COMMAND_2 = re.compile(r"^python3 -m venv \.venv && \.venv/bin/pip install -e '\.\[dev\]'.*$", re.M)


@dataclass(frozen=True)
class DevServer:
    url: str
    key: str
    workdir: Path


def _ratchet_command() -> list[str]:
    # The console script next to this interpreter first: the venv need not be on PATH.
    found = shutil.which("ratchet", path=str(Path(sys.executable).parent)) or shutil.which(
        "ratchet"
    )
    if found is None:
        return [sys.executable, "-c", "from ratchet.cli import app; app(prog_name='ratchet')"]
    return [found]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _clean_env() -> dict[str, str]:
    """This environment without any RATCHET_* setting, so the tour sees the embedded default."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    # `python3` in the tour resolves even where only this interpreter is installed.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _wait_until_ready(proc: subprocess.Popen[bytes], stdout: Path, stderr: Path) -> DevServer:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ratchet dev exited with {proc.returncode}:\n{stderr.read_text()}")
        found = EXPORT_LINE.search(stdout.read_text())
        if found:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{found['url']}/healthz", timeout=2).status_code == 200:
                    return DevServer(found["url"], found["key"], stdout.parent)
        time.sleep(0.2)
    pytest.fail(
        f"ratchet dev did not answer within {START_TIMEOUT_SECONDS} s\n"
        f"stdout:\n{stdout.read_text()}\nstderr:\n{stderr.read_text()}"
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the whole process group, then SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)


@pytest.fixture
def dev_server(tmp_path: Path) -> Iterator[DevServer]:
    """``ratchet dev`` on a free port, in a fresh working directory, stopped afterwards."""
    stdout, stderr = tmp_path / "stdout.log", tmp_path / "stderr.log"
    command = [*_ratchet_command(), "dev", "--port", str(_free_port())]
    with stdout.open("wb") as out, stderr.open("wb") as err:
        proc = subprocess.Popen(
            command, cwd=tmp_path, env=_clean_env(), stdout=out, stderr=err, start_new_session=True
        )
    try:
        yield _wait_until_ready(proc, stdout, stderr)
    finally:
        _stop(proc)


def tour_script(readme: str) -> str:
    """Every ```sh block between the tour markers, in order, as one script."""
    found = TOUR.search(readme)
    assert found, "README.md has no <!-- tour --> … <!-- /tour --> section"
    blocks = [m["code"] for m in SH_BLOCK.finditer(found["body"])]
    assert blocks, "the README tour has no ```sh blocks"
    return "\n".join(blocks)


def test_readme_tour_runs_word_for_word(dev_server: DevServer) -> None:
    script = tour_script(README.read_text())
    env = {**_clean_env(), "RATCHET_URL": dev_server.url, "RATCHET_KEY": dev_server.key}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=dev_server.workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=TOUR_TIMEOUT_SECONDS,
        check=False,
    )
    report = f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, report
    assert '"status": "succeeded"' in done.stdout, report
    assert "The answer is 42." in done.stdout, report
    assert "application/problem+json" in done.stdout, report
    assert "What is my name?" in done.stdout, report  # the thread's second turn, read back
    assert "event: message.delta" in done.stdout, report  # the answer, as it was written


def _same_default(documented: str, default: object) -> bool:
    if documented == "*(empty)*":
        return default in ("", None, [])
    value = documented.strip("`")
    if isinstance(default, int | float) and not isinstance(default, bool):
        return float(value) == default
    return value == str(default)


def test_configuration_reference_documents_every_setting_and_its_default() -> None:
    from shared.settings import Settings

    documented = dict(SETTING_ROW.findall(CONFIGURATION.read_text()))
    fields = {f"RATCHET_{name.upper()}": f.default for name, f in Settings.model_fields.items()}
    assert documented.keys() == fields.keys(), (
        f"missing from {CONFIGURATION.name}: {sorted(fields.keys() - documented.keys())}; "
        f"not settings: {sorted(documented.keys() - fields.keys())}"
    )
    wrong = {
        k: (documented[k], d) for k, d in fields.items() if not _same_default(documented[k], d)
    }
    assert not wrong, f"{CONFIGURATION.name} defaults differ from shared/settings.py: {wrong}"


def test_ci_runs_readme_command_2() -> None:
    commands = COMMAND_2.findall(README.read_text())
    assert len(commands) == 1, "README.md should give command 2 on a line of its own, once"
    assert commands[0] in (ROOT / ".ci" / "run").read_text()
