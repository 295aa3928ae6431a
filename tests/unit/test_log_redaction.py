"""httpx's line for each request a process sends ("HTTP Request: POST <url> ...") names the
URL without its credentials: no ``user:password@``, no query value."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from shared.observability.logs import redact_url

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
