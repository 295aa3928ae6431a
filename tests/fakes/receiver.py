"""A webhook receiver over real HTTP on 127.0.0.1, recording every request it gets.

Each path answers ``200`` unless told otherwise; a test scripts the first answers of a path
and what it says after them::

    with WebhookReceiver() as receiver:
        receiver.respond("/hooks", 500, 500, 500)      # three failures, then 200
        receiver.respond("/gone", then=410)            # always 410
        submit(webhook={"url": receiver.url("/hooks")})
        [first, *retries] = receiver.wait_for(4, path="/hooks")

``WebhookReceiver(down=True)`` holds its port without listening, so a sender's connection is
refused (not timed out) until :meth:`up` starts it on that same port.
``WebhookReceiver(delay=s)`` records each request at once and answers it ``s`` seconds later:
a sender killed in between has sent a request and never read its answer.
``receiver.hang(path)`` records each request to ``path`` and never answers it;
``receiver.hang(path, drip=s)`` starts an answer and sends one more byte of it every ``s``
seconds, never ending it. Either holds the connection until the sender gives up or the
receiver closes.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any


@dataclass(frozen=True)
class Received:
    """One request as it arrived: path, headers (lower-cased names), raw body, arrival time."""

    path: str
    headers: Mapping[str, str]
    body: bytes
    at: float  # time.monotonic()
    answered: int

    @property
    def webhook_id(self) -> str:
        return self.headers["webhook-id"]

    def json(self) -> Any:
        """The body as JSON (None when it is empty)."""
        return json.loads(self.body or b"null")


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # hundreds of workers' threads may connect at once
    daemon_threads = True
    receiver: WebhookReceiver


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a sender's pooled client expects
    server: _Server

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {name.lower(): value for name, value in self.headers.items()}
        receiver = self.server.receiver
        status = receiver.record(self.path, headers, body)
        if self.path in receiver.hanging:
            self._hang(receiver.hanging[self.path], receiver.closing)
            return
        time.sleep(receiver.delay)
        answer = b"ok" if 200 <= status < 300 else f"answered {status}".encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the sender died while the answer was held back

    def _hang(self, drip: float | None, closing: threading.Event) -> None:
        """Never answer (``drip`` None), or drip an endless answer one byte at a time."""
        self.close_connection = True
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Drip: "
        sent = 0
        while not closing.wait(drip if drip is not None else 0.05):
            if drip is None:
                continue
            try:
                self.wfile.write(head[sent : sent + 1] if sent < len(head) else b"x")
                self.wfile.flush()
            except OSError:
                return  # the sender gave up
            sent += 1

    def log_message(self, format: str, *args: Any) -> None:
        pass


class WebhookReceiver:
    """Webhook endpoints on one port: ``url(path)`` for each, answers scripted per path."""

    def __init__(self, *, down: bool = False, delay: float = 0.0) -> None:
        self.delay = delay
        self._lock = threading.Condition()
        self._received: list[Received] = []
        self._scripted: dict[str, deque[int]] = defaultdict(deque)
        self._then: dict[str, int] = {}
        self.hanging: dict[str, float | None] = {}
        self.closing = threading.Event()
        self._httpd = _Server(("127.0.0.1", 0), _Handler, bind_and_activate=False)
        self._httpd.receiver = self
        self._httpd.server_bind()  # the port is ours from now on; refused until it listens
        self._thread: threading.Thread | None = None
        self._down = down

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def url(self, path: str = "/hooks") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def respond(self, path: str, *statuses: int, then: int = 200) -> None:
        """Answer the next requests to ``path`` with ``statuses`` in turn, then ``then``."""
        with self._lock:
            self._scripted[path] = deque(statuses)
            self._then[path] = then

    def hang(self, path: str, *, drip: float | None = None) -> None:
        """Never answer requests to ``path``: say nothing, or drip bytes every ``drip`` s."""
        self.hanging[path] = drip

    def up(self) -> None:
        """Start answering on the port (a no-op if already up)."""
        if self._thread is not None:
            return
        self._httpd.server_activate()
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="webhook-receiver",
            daemon=True,
        )
        self._thread.start()

    def record(self, path: str, headers: dict[str, str], body: bytes) -> int:
        with self._lock:
            scripted = self._scripted[path]
            status = scripted.popleft() if scripted else self._then.get(path, 200)
            self._received.append(Received(path, headers, body, time.monotonic(), status))
            self._lock.notify_all()
        return status

    def received(self, path: str | None = None) -> list[Received]:
        with self._lock:
            return [r for r in self._received if path is None or r.path == path]

    def by_header(self, name: str) -> dict[str, list[Received]]:
        """Every request so far, grouped by the value of its header ``name`` (lower case)."""
        grouped: dict[str, list[Received]] = defaultdict(list)
        for request in self.received():
            grouped[request.headers.get(name, "")].append(request)
        return grouped

    def wait_for(
        self, count: int, *, path: str | None = None, timeout: float = 20.0
    ) -> list[Received]:
        """Block until at least ``count`` requests (to ``path``) arrived; return them all."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                got = [r for r in self._received if path is None or r.path == path]
                left = deadline - time.monotonic()
                if len(got) >= count:
                    return got
                if left <= 0:
                    raise AssertionError(
                        f"{len(got)} of {count} webhook request(s) to {path or 'any path'} "
                        f"arrived within {timeout} s"
                    )
                self._lock.wait(timeout=left)

    def close(self) -> None:
        self.closing.set()  # hanging requests end, and their connections close
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()

    def __enter__(self) -> WebhookReceiver:
        if not self._down:
            self.up()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
