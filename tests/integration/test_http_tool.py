"""``http_request`` against a hostile server on loopback: the whole exchange has a deadline
(not each read), the body is read up to its cap and no further, and a ``Host`` header from the
model is not forwarded. And its kept connections: reused across calls to one host, the
deadline still cutting an exchange on a kept one, every connection going to the address the
egress policy vetted for its call, and none shared with a forked child."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from shared.agents import http_exchange
from shared.agents.http_exchange import BODY_CAP_BYTES
from shared.agents.registry import ToolContext, get_tool, load
from shared.errors import EgressDenied, ToolError
from shared.settings import get_settings
from tests.fakes.drip_server import DripServer
from tests.helpers import bounded

CONTEXT = ToolContext(task_id="t", tenant_id="x", call_id="1-0", idempotency_key="t:1-0")
SHORT_LIMIT_SECONDS = 1.0  # for the drips: they end only at the limit
LONG_LIMIT_SECONDS = 15.0  # for the others: they must end well before it


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[DripServer]:
    monkeypatch.setenv("RATCHET_HTTP_ALLOWED_HOSTS", "127.0.0.1")
    monkeypatch.setenv("RATCHET_TOOL_TIMEOUT_SECONDS", str(LONG_LIMIT_SECONDS))
    get_settings.cache_clear()
    with DripServer(interval=0.1) as drip:
        yield drip
    get_settings.cache_clear()


@pytest.fixture
def short_limit(server: DripServer, monkeypatch: pytest.MonkeyPatch) -> DripServer:
    monkeypatch.setenv("RATCHET_TOOL_TIMEOUT_SECONDS", str(SHORT_LIMIT_SECONDS))
    get_settings.cache_clear()
    return server


def http_request(**arguments: Any) -> Any:
    load()
    return get_tool("http_request").invoke(arguments, CONTEXT)


@pytest.mark.parametrize("path", ["/drip-body", "/drip-head"])
def test_a_server_that_drips_is_cut_off_at_the_tools_limit(
    short_limit: DripServer, path: str
) -> None:
    # A byte every 0.1 s: no read ever waits as long as the limit, so only a deadline on the
    # whole exchange ends the call.
    result, took = bounded(lambda: http_request(url=short_limit.url(path)))
    assert isinstance(result, ToolError), result
    assert f"did not complete within {SHORT_LIMIT_SECONDS:g} s" in str(result)
    assert took >= SHORT_LIMIT_SECONDS


def test_an_endless_body_is_cut_at_the_cap_without_reading_on(server: DripServer) -> None:
    result, took = bounded(lambda: http_request(url=server.url("/endless")))
    assert not isinstance(result, Exception), result
    assert result["status"] == 200
    assert result["truncated"] is True
    assert len(result["body"].encode()) == BODY_CAP_BYTES
    assert took < LONG_LIMIT_SECONDS  # cut at the cap, not at the deadline


def test_a_body_within_the_cap_is_whole_and_not_truncated(server: DripServer) -> None:
    result, _ = bounded(lambda: http_request(url=server.url("/echo")))
    assert not isinstance(result, Exception), result
    assert result["truncated"] is False
    assert json.loads(result["body"]) == {"host": server.url("").removeprefix("http://")}


def test_a_host_header_from_the_model_is_not_forwarded(server: DripServer) -> None:
    headers = {"Host": "internal.example", "X-Kept": "yes", "idempotency-key": "forged"}
    result, _ = bounded(lambda: http_request(url=server.url("/echo"), headers=headers))
    assert not isinstance(result, Exception), result
    [received] = server.requests
    assert received.headers["host"] == server.url("").removeprefix("http://")
    assert received.headers["x-kept"] == "yes"
    assert received.headers["idempotency-key"] == CONTEXT.idempotency_key


class KeptServer:
    """An HTTP/1.1 server on ``address`` that keeps connections open: ``/peer`` answers with
    the number of the connection it came on; ``/drip`` sends its head, then a byte every
    0.1 s until closed. Each request is logged as (path, connection number, Host)."""

    def __init__(self, address: str, port: int = 0) -> None:
        self.log: list[tuple[str, int, str]] = []
        self.connections = 0
        self.closing = threading.Event()
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer((address, port), _KeptHandler)
        self._httpd.daemon_threads = True
        self._httpd.kept = self  # type: ignore[attr-defined]
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def connected(self) -> int:
        with self._lock:
            self.connections += 1
            return self.connections

    def record(self, path: str, connection: int, host: str) -> None:
        with self._lock:
            self.log.append((path, connection, host))

    def __enter__(self) -> KeptServer:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.closing.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class _KeptHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.kept: KeptServer = self.server.kept  # type: ignore[attr-defined]
        self.number = self.kept.connected()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.kept.record(self.path, self.number, self.headers.get("host", ""))
        if self.path == "/drip":
            self._head("1000000")
            try:
                while not self.kept.closing.wait(0.1):
                    self.wfile.write(b"a")
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass
            self.close_connection = True
            return
        body = json.dumps({"connection": self.number}).encode()
        self._head(str(len(body)))
        self.wfile.write(body)

    def _head(self, length: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", length)
        self.end_headers()
        self.wfile.flush()


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> Iterator[KeptServer]:
    monkeypatch.setenv("RATCHET_HTTP_ALLOWED_HOSTS", "127.0.0.1")
    monkeypatch.setenv("RATCHET_TOOL_TIMEOUT_SECONDS", str(LONG_LIMIT_SECONDS))
    get_settings.cache_clear()
    # A process of its own clients: none kept from another test.
    monkeypatch.setattr(http_exchange._process, "clients", http_exchange.Clients())
    monkeypatch.setattr(http_exchange, "KEEPALIVE_SECONDS", 60.0)  # a slow machine's pauses
    with KeptServer("127.0.0.1") as server:
        yield server
    get_settings.cache_clear()


def connection_of(url: str) -> int:
    result, _ = bounded(lambda: http_request(url=url))
    assert not isinstance(result, Exception), result
    assert result["status"] == 200
    return int(json.loads(result["body"])["connection"])


def test_calls_to_one_host_reuse_its_kept_connection(kept: KeptServer) -> None:
    numbers = {connection_of(kept.url("/peer")) for _ in range(5)}
    assert numbers == {1}
    assert kept.connections == 1


def test_the_deadline_cuts_an_exchange_on_a_kept_connection(
    kept: KeptServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = connection_of(kept.url("/peer"))
    monkeypatch.setenv("RATCHET_TOOL_TIMEOUT_SECONDS", str(SHORT_LIMIT_SECONDS))
    get_settings.cache_clear()
    result, took = bounded(lambda: http_request(url=kept.url("/drip")))
    assert isinstance(result, ToolError), result
    assert f"did not complete within {SHORT_LIMIT_SECONDS:g} s" in str(result)
    assert took >= SHORT_LIMIT_SECONDS
    assert kept.log[-1][:2] == ("/drip", first)  # on the kept connection
    # The connection cut is not kept: the next call makes a new one.
    assert connection_of(kept.url("/peer")) != first


@pytest.fixture
def vetted(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[KeptServer, KeptServer, dict[str, str]]]:
    """A host, ``tool.test``, off the allow-list: the policy vets what ``answer["vetted"]``
    says it resolves to, counting only 127.0.0.1 as public, while the system resolver says
    127.0.0.2, a forbidden address where another server listens on the same port."""
    monkeypatch.setenv("RATCHET_HTTP_ALLOWED_HOSTS", "")
    monkeypatch.setenv("RATCHET_TOOL_TIMEOUT_SECONDS", str(LONG_LIMIT_SECONDS))
    get_settings.cache_clear()
    monkeypatch.setattr(http_exchange._process, "clients", http_exchange.Clients())
    monkeypatch.setattr(http_exchange, "KEEPALIVE_SECONDS", 60.0)  # a slow machine's pauses
    from shared.webhooks import egress

    answer = {"vetted": "127.0.0.1"}
    monkeypatch.setattr(egress, "is_public", lambda address: str(address) == "127.0.0.1")
    monkeypatch.setattr(
        egress, "_resolve", lambda host, port: [ipaddress.ip_address(answer["vetted"])]
    )
    system = socket.getaddrinfo

    def resolver(host: Any, *args: Any, **kwargs: Any) -> Any:
        return system("127.0.0.2" if host == "tool.test" else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    with KeptServer("127.0.0.1") as good, KeptServer("127.0.0.2", good.port) as forbidden:
        yield good, forbidden, answer
    get_settings.cache_clear()


def test_every_connection_goes_to_the_address_vetted_for_its_call(
    vetted: tuple[KeptServer, KeptServer, dict[str, str]],
) -> None:
    good, forbidden, answer = vetted
    url = good.url("/peer", host="tool.test")
    assert connection_of(url) == connection_of(url) == 1  # made to the vetted address, kept
    # Now the host resolves to a forbidden address: the call is refused, though a connection
    # to the host is kept.
    answer["vetted"] = "127.0.0.2"
    refused, _ = bounded(lambda: http_request(url=url))
    assert isinstance(refused, EgressDenied), refused
    assert "non-public address" in str(refused)
    # Back to the public one, with its kept connection gone: the new connection goes to the
    # vetted address, not to what the system resolver says now.
    answer["vetted"] = "127.0.0.1"
    http_exchange._process.clients = http_exchange.Clients()
    assert connection_of(url) == 2
    assert forbidden.log == []
    assert forbidden.connections == 0
    assert {host for _, _, host in good.log} == {f"tool.test:{good.port}"}


def test_a_forked_child_makes_its_own_connections(kept: KeptServer) -> None:
    url = kept.url("/peer")
    parents = connection_of(url)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one call, its connection's number to the parent, and out
        code = 1
        try:
            os.write(write, str(connection_of(url)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        childs = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert int(childs) != parents
    assert connection_of(url) == parents  # the parent's connection is still its own, intact
