"""Log lines: plain text or one JSON object each, carrying the step they were written in; and
httpx's line for each request a process sends ("HTTP Request: POST <url> ..."), which names the
URL without its credentials: no ``user:password@``, no query value."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shared.observability import logs
from shared.observability.logs import redact_url


def record(message: str = "hello %s", *args: object, **extra: object) -> logging.LogRecord:
    made = logging.LogRecord("ratchet.step", logging.INFO, __file__, 1, message, args, None)
    for name, value in extra.items():
        setattr(made, name, value)
    return made


def test_a_json_line_carries_the_bound_step() -> None:
    formatter = logs.JsonFormatter()
    with logs.bound(task_id="tsk_1", step=None):
        with logs.bound(step=3, lease_epoch=7):
            line = json.loads(formatter.format(record("step %d committed", 3)))
        outside = json.loads(formatter.format(record()))
    assert line["message"] == "step 3 committed"
    assert (line["level"], line["logger"]) == ("INFO", "ratchet.step")
    assert (line["task_id"], line["step"], line["lease_epoch"]) == ("tsk_1", 3, 7)
    assert line["time"].endswith("+00:00")
    assert outside["task_id"] == "tsk_1"
    assert "step" not in outside  # bound as None: left out
    assert "task_id" not in json.loads(formatter.format(record()))


def test_fields_passed_with_extra_win_and_a_traceback_stays_inside_the_line() -> None:
    formatter = logs.JsonFormatter()
    try:
        raise ValueError("boom")
    except ValueError:
        failed = record("it failed", task_id="tsk_2")
        failed.exc_info = sys.exc_info()
    with logs.bound(task_id="tsk_1"):
        text = formatter.format(failed)
    assert "\n" not in text
    line = json.loads(text)
    assert line["task_id"] == "tsk_2"
    assert "ValueError: boom" in line["exc_info"]


def test_a_text_line_ends_with_the_fields_before_any_traceback() -> None:
    formatter = logs.TextFormatter()
    try:
        raise ValueError("boom")
    except ValueError:
        failed = record("it failed")
        failed.exc_info = sys.exc_info()
    with logs.bound(task_id="tsk_1", step=2):
        first, *rest = formatter.format(failed).splitlines()
    assert first.endswith("ratchet.step: it failed [task_id=tsk_1 step=2]")
    assert rest[-1] == "ValueError: boom"


def test_configuring_again_replaces_only_its_own_handler(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = logging.getLogger()
    others = [h for h in root.handlers if h.get_name() != "ratchet"]
    level = root.level
    try:
        logs.configure(log_format="text", level="INFO")
        logs.configure(log_format="json", level="WARNING")
        ours = [h for h in root.handlers if h.get_name() == "ratchet"]
        assert len(ours) == 1
        assert isinstance(ours[0].formatter, logs.JsonFormatter)
        assert [h for h in root.handlers if h.get_name() != "ratchet"] == others
        assert root.level == logging.WARNING
    finally:
        for handler in [h for h in root.handlers if h.get_name() == "ratchet"]:
            root.removeHandler(handler)
        root.setLevel(level)


def test_checking_the_schema_logs_nothing_at_info(tmp_path: Path) -> None:
    """A fresh process (alembic says hello once per process) that checks a migrated schema
    at INFO, as every API and worker process does at start, prints no alembic lines."""
    from shared.store.db import migrate

    url = f"sqlite:///{tmp_path / 'r.db'}"
    migrate(url)
    code = (
        "from shared.observability import logs; from shared.store.db import require_migrated; "
        "from sqlalchemy import create_engine; "
        "logs.configure(log_format='text', level='INFO'); "
        f"require_migrated(create_engine({url!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "alembic" not in done.stderr, done.stderr


SEND_ONE = textwrap.dedent(
    """
    import http.server, threading, httpx
    from shared.observability import logs

    class Quiet(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    logs.configure(log_format="text", level="INFO")
    port = server.server_address[1]
    url = f"http://hook-user:hunter2@127.0.0.1:{port}/hooks/in?token=s3cr3t&team=ops"
    assert httpx.post(url, json={}).status_code == 204
    """
)


def test_a_sent_requests_log_line_carries_no_credentials() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SEND_ONE], capture_output=True, text=True, timeout=60, check=True
    )
    lines = [line for line in done.stderr.splitlines() if "HTTP Request:" in line]
    assert len(lines) == 1, done.stderr
    assert "/hooks/in?token=REDACTED&team=REDACTED" in lines[0]
    assert "127.0.0.1" in lines[0]
    assert ' 204 No Content"' in lines[0]
    for secret in ("hunter2", "hook-user", "s3cr3t", "ops"):
        assert secret not in lines[0]


@pytest.mark.parametrize(
    ("url", "logged"),
    [
        ("https://a:b@example.com/x?k=v#frag", "https://example.com/x?k=REDACTED"),
        ("https://example.com:8443/x", "https://example.com:8443/x"),
        ("http://user@[::1]:8080/x?", "http://[::1]:8080/x"),
    ],
)
def test_a_url_keeps_where_it_goes_and_loses_its_secrets(url: str, logged: str) -> None:
    assert redact_url(url) == logged
