"""A hostile HTTP server on 127.0.0.1 for the ``http_request`` tool: it holds its callers.

Paths:

- ``/drip-body``: a 200 whose head arrives at once and whose body then comes one byte every
  ``interval`` seconds, for ever (its Content-Length promises a megabyte).
- ``/drip-head``: a head that never ends, one byte every ``interval`` seconds.
- ``/endless``: a 200 whose body never ends (16 KiB every few ms until the caller hangs up).
- ``/echo``: a 200 at once, whose JSON body says the ``Host`` header it got.

Every request is recorded (path and headers). A per-read timeout never fires on the drips:
only a deadline on the whole exchange ends them. Closing the server ends every response it
still sends::

    with DripServer(interval=0.1) as server:
        http_request(server.url("/drip-body"), context)
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

ENDLESS_CHUNK = b"x" * 16384


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]  # names lower-cased


class DripServer:
    """The server and its request log; a context manager."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.closing = threading.Event()
        self._received: list[Received] = []
        self._lock = threading.Lock()
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.drip = self
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="drip-server",
            daemon=True,
        )

    def url(self, path: str) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}{path}"

    @property
    def requests(self) -> list[Received]:
        with self._lock:
            return list(self._received)

    def record(self, received: Received) -> None:
        with self._lock:
            self._received.append(received)

    def __enter__(self) -> DripServer:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.closing.set()  # every response still being sent ends
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256
    drip: DripServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the request log is self.server.drip.requests

    def _handle(self) -> None:
        drip = self.server.drip
        drip.record(Received(self.path, {k.lower(): v for k, v in self.headers.items()}))
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        try:
            if self.path == "/echo":
                self._echo()
            elif self.path == "/endless":
                self._head({"Connection": "close"})
                self._send_until_closed(ENDLESS_CHUNK, pause=0.005)
            elif self.path == "/drip-head":
                self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Drip: ")
                self._send_until_closed(b"a", pause=drip.interval)
            else:
                self._head({"Content-Length": "1000000"})
                self._send_until_closed(b"a", pause=drip.interval)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the caller hung up: what the deadline is for
        self.close_connection = True

    def _echo(self) -> None:
        body = json.dumps({"host": self.headers.get("host")}).encode()
        self._head({"Content-Type": "application/json", "Content-Length": str(len(body))})
        self.wfile.write(body)

    def _head(self, headers: dict[str, str]) -> None:
        self.send_response(200)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.flush()

    def _send_until_closed(self, data: bytes, *, pause: float) -> None:
        closing = self.server.drip.closing
        while not closing.is_set():
            self.wfile.write(data)
            self.wfile.flush()
            closing.wait(pause)
