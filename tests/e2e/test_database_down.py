"""A database that goes silent (a partition, a hung proxy) holds no request for ever: every one
gets a 503 within the configured timeouts, and /healthz answers all the while.

The API reaches PostgreSQL through a TCP proxy in this test. Switched to silent, the proxy
keeps every connection open, accepts new ones, and forwards nothing: TCP itself never says
the server is gone, so only the API's own timeouts end the waits.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.conftest import TenantHandle
from tests.e2e.conftest import Stack

REQUESTS = 50  # more than the API's thread pool (40) and its database pool together
# Generous: the timeouts below are 2 s; a request waits for a pooled connection, for one
# (bounded) connection attempt, or for one silent statement (2 s + 5 s grace).
ANSWER_WITHIN_SECONDS = 60.0
HEALTHZ_WITHIN_SECONDS = 5.0


class SilentableProxy:
    """Forwards TCP connections to ``target`` until :meth:`go_silent`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.silent = threading.Event()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def go_silent(self) -> None:
        self.silent.set()

    def close(self) -> None:
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._sockets.append(client)
            if self.silent.is_set():
                continue  # accepted, and never answered
            upstream = socket.create_connection(self.target)
            self._sockets.append(upstream)
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if not self.silent.is_set():
                    sink.sendall(data)


@pytest.fixture
def proxy(service_env: dict[str, str]) -> Iterator[SilentableProxy]:
    url = make_url(service_env["RATCHET_DATABASE_URL"])
    started = SilentableProxy((url.host or "127.0.0.1", url.port or 5432))
    yield started
    started.close()


def test_a_silent_database_is_a_503_for_every_request_and_healthz_still_answers(
    stack: Callable[..., Stack],
    proxy: SilentableProxy,
    service_env: dict[str, str],
    tenant: TenantHandle,
) -> None:
    url = make_url(service_env["RATCHET_DATABASE_URL"]).set(host="127.0.0.1", port=proxy.port)
    api = stack(
        workers=0,
        env={
            "RATCHET_DATABASE_URL": url.render_as_string(hide_password=False),
            "RATCHET_DB_CONNECT_TIMEOUT_SECONDS": "2",
            "RATCHET_DB_POOL_TIMEOUT_SECONDS": "2",
            "RATCHET_DB_STATEMENT_TIMEOUT_SECONDS": "2",
        },
    )
    with api.client(headers=tenant.headers) as http:
        # Through the proxy the API works, and its pool holds connections that will go silent.
        assert http.get("/v1/tasks").status_code == 200
        proxy.go_silent()
        # Each reads the database (/v1/agents does not, once the API has just verified the
        # key: it is answered from the registry).
        missing = "/v1/tasks/00000000-0000-0000-0000-000000000000"
        paths = ["/v1/tasks", missing, f"{missing}/steps"]

        def call(index: int) -> tuple[httpx.Response, float]:
            started = time.monotonic()
            response = http.get(paths[index % len(paths)], timeout=ANSWER_WITHIN_SECONDS)
            return response, time.monotonic() - started

        with ThreadPoolExecutor(REQUESTS) as pool:
            futures = [pool.submit(call, i) for i in range(REQUESTS)]
            time.sleep(1)  # every request is in; the API's threads are all waiting
            while not all(f.done() for f in futures):
                health = httpx.get(f"{api.url}/healthz", timeout=HEALTHZ_WITHIN_SECONDS)
                assert health.json() == {"status": "ok"}
                time.sleep(0.5)
            results = [f.result() for f in futures]
    for response, _ in results:
        assert response.status_code == 503, response.text
        assert response.headers["content-type"].startswith("application/problem+json")
        assert response.json()["type"] == "urn:ratchet:problem:database-unavailable"
        assert int(response.headers["Retry-After"]) > 0
    slowest = max(elapsed for _, elapsed in results)
    print(f"{REQUESTS} requests to a silent database: slowest 503 after {slowest:.1f} s")
