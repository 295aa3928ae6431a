"""The ``http_request`` tool's exchange with a server, bounded in time and in size.

httpx's timeouts bound each network operation (a connect, a read), never a whole exchange: a
server that sends a byte now and then, in its headers or its body, would hold the call for
ever, and with it a thread of the worker's tool pool. Here one deadline covers the whole
exchange: the connect is bounded by it, and at the deadline the connection's socket is shut
down under whatever reads or writes it then (the TLS handshake, the request, the response's
head or body), which fails at once. The body is streamed and read up to a cap, so an endless
or enormous body is cut there and never held whole.

The deadline does not cover resolving an allow-listed host's name (the system resolver's own
timeouts bound that); a host that is not allow-listed is resolved, and pinned, before.

Connections are kept and reused: each process has one client per host (built once, on the
process's one TLS context), so a call to a host already called takes a kept connection, not a
TCP and TLS handshake. The pinning is as strict as with a connection per call: a pinned
request's URL names the vetted address (the Host header and TLS server name the host's), so a
connection is only ever reused for a call whose vetted address is the one it was made to, and a
new one goes to the address vetted for the call that makes it; a host's client holds only that
host's connections, so none is ever reused for another host that shares its address. A forked
child starts with no clients: it never shares a connection with its parent.
"""

from __future__ import annotations

import codecs
import contextlib
import heapq
import itertools
import os
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpcore
import httpx

from shared.errors import ToolError
from shared.webhooks.egress import Destination, pinned_stream

BODY_CAP_BYTES = 64 * 1024
# Never forwarded as the model gave them: the call's own Idempotency-Key is sent instead, and
# the Host is the URL's (a forged one would reach another virtual host than the one vetted).
NOT_FORWARDED = frozenset({"host", "idempotency-key"})


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: str  # the first BODY_CAP_BYTES of it, decoded
    truncated: bool  # the body went on past the cap

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "headers": self.headers,
            "body": self.body,
            "truncated": self.truncated,
        }


def outgoing_headers(headers: Mapping[str, str] | None, *, idempotency_key: str) -> dict[str, str]:
    """The headers to send: the model's, less those never forwarded, plus the call's key."""
    sent = {k: v for k, v in (headers or {}).items() if k.lower() not in NOT_FORWARDED}
    sent["Idempotency-Key"] = idempotency_key
    return sent


def exchange(
    destination: Destination,
    *,
    method: str,
    headers: Mapping[str, str],
    json: Any,
    seconds: float,
) -> Reply:
    """Send the request and read the reply, all within ``seconds``; any failure, the deadline
    included, is a :class:`ToolError` that says what happened."""
    what = f"{method} {destination.url}"
    client = client_for(destination.host)
    with Cutoff(seconds) as cutoff:
        try:
            with pinned_stream(
                client, destination, method=method, headers=headers, json=json, timeout=seconds
            ) as response:
                body, truncated = read_capped(response)
                # The connection goes back to the pool as this block ends, and may be another
                # call's at once: the deadline must no longer shut it down.
                cutoff.stop()
        except httpx.HTTPError as exc:
            # Each operation's own timeout is the whole limit too: one that ran out is the
            # deadline's as well.
            if cutoff.fired or isinstance(exc, httpx.TimeoutException):
                raise ToolError(f"{what} did not complete within {seconds:g} s") from exc
            raise ToolError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
        if cutoff.fired:  # a body read up to the close the deadline made may look complete
            raise ToolError(f"{what} did not complete within {seconds:g} s")
    text = _decode(body, response.encoding or "utf-8", complete=not truncated)
    return Reply(response.status_code, dict(response.headers), text, truncated)


def read_capped(response: httpx.Response) -> tuple[bytes, bool]:
    """The body's first ``BODY_CAP_BYTES``, and whether there was more: reading stops there."""
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > BODY_CAP_BYTES:
            return bytes(body[:BODY_CAP_BYTES]), True
    return bytes(body), False


def _decode(body: bytes, encoding: str, *, complete: bool) -> str:
    """The body as text; a character cut in two by the cap is left out."""
    try:
        decoder = codecs.getincrementaldecoder(encoding)(errors="replace")
    except LookupError:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return decoder.decode(body, final=complete)


class Cutoff:
    """Shuts down the connection of an exchange that is still going at its deadline.

    The connection's socket is learnt as the exchange first uses it (a new connection as it is
    made, a kept one at its first read or write: see :class:`_Stream`), and kept as a duplicate
    descriptor of its own: shutting that down ends the connection under the exchange's reads,
    TLS or not, and it can never be another connection's, as a descriptor closed by httpx and
    opened again could. The duplicate is closed when the exchange ends; a connection shut down
    at the deadline fails, and is never kept for another call. The cutoff watches the
    connections its thread uses while it is entered (an exchange runs on its caller's
    thread). The process's :class:`Clock` fires it at its deadline."""

    def __init__(self, seconds: float) -> None:
        self.fired = False
        self._seconds = seconds
        self._socket: socket.socket | None = None
        self._connection: object = None  # what the socket is a duplicate of
        self._over = False
        self._lock = threading.Lock()

    def __enter__(self) -> Cutoff:
        _watching.cutoff = self
        _process.clock.add(time.monotonic() + self._seconds, self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _watching.cutoff = None
        with self._lock:
            self._over = True
            if self._socket is not None:
                self._socket.close()

    def stop(self) -> None:
        """The exchange is over: from now on the deadline does nothing."""
        with self._lock:
            self._over = True

    def watch(self, connection: object, sock: socket.socket) -> None:
        """Note ``sock``, the socket of ``connection``, unless it is the one noted already."""
        if connection is self._connection:
            return
        made = socket.socket(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno()))
        with self._lock:
            if self._socket is not None:
                self._socket.close()
            self._socket, self._connection = made, connection
            if self.fired:  # connected, or taken from the pool, just as the deadline passed
                _shut(self._socket)

    def fire(self) -> None:
        """The deadline passed: shut the connection down, unless the exchange is over."""
        with self._lock:
            if self._over:
                return
            self.fired = True
            if self._socket is not None:
                _shut(self._socket)


class Clock:
    """One thread per process that fires each cutoff at its deadline (a timer thread per
    exchange cost a thread's start, and its stack, on every call). A cutoff whose exchange
    ended stays queued until its deadline and is then passed over."""

    def __init__(self) -> None:
        self._queue: list[tuple[float, int, Cutoff]] = []
        self._order = itertools.count()
        self._changed = threading.Condition(threading.Lock())
        self._running = False

    def add(self, deadline: float, cutoff: Cutoff) -> None:
        with self._changed:
            heapq.heappush(self._queue, (deadline, next(self._order), cutoff))
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="http-cutoffs", daemon=True).start()
            elif self._queue[0][2] is cutoff:  # sooner than the one the thread waits for
                self._changed.notify()

    def _run(self) -> None:
        with self._changed:
            while True:
                now = time.monotonic()
                while self._queue and self._queue[0][0] <= now:
                    heapq.heappop(self._queue)[2].fire()
                self._changed.wait(self._queue[0][0] - now if self._queue else None)


class _Watching(threading.local):
    cutoff: Cutoff | None = None


_watching = _Watching()


def _watch(connection: object, stream: httpcore.NetworkStream) -> None:
    cutoff = _watching.cutoff
    if cutoff is not None:
        cutoff.watch(connection, stream.get_extra_info("socket"))


class _Stream(httpcore.NetworkStream):
    """A connection's stream that shows itself to the exchange using it: at each read and
    write, the thread's :class:`Cutoff` learns its socket (a dictionary look-up once it knows
    it). ``connection`` stays the same across the TLS upgrade, which makes a new stream."""

    def __init__(self, inner: httpcore.NetworkStream, connection: object) -> None:
        self._inner = inner
        self._connection = connection

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        _watch(self._connection, self._inner)
        return self._inner.read(max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        _watch(self._connection, self._inner)
        self._inner.write(buffer, timeout)

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        tls = self._inner.start_tls(ssl_context, server_hostname, timeout)
        return _Stream(tls, self._connection)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    """httpcore's own network backend, whose connections are :class:`_Stream` s, each shown
    to the exchange that makes it as soon as it is made (before any TLS handshake)."""

    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        inner = self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        stream = _Stream(inner, connection=object())
        _watch(stream._connection, inner)
        return stream

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:  # pragma: no cover - no URL of the tool's names a socket
        inner = self._inner.connect_unix_socket(path, timeout, socket_options)
        stream = _Stream(inner, connection=object())
        _watch(stream._connection, inner)
        return stream

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


# Kept connections per host: as many as the calls to one host that finish together, up to
# this; past it a connection closes when its exchange ends. httpcore notices one the server
# closed before reusing it, and closes one idle for KEEPALIVE_SECONDS: less than the shortest
# idle timeout common servers keep (gunicorn's 2 s; uvicorn's and Node's 5 s), so a call
# never goes out on a connection at the moment its server closes it, which would fail it.
KEEPALIVE_PER_HOST = 128
KEEPALIVE_SECONDS = 1.5
HOSTS_KEPT = 64  # clients kept per process; the least recently used goes past it


class Clients:
    """A process's clients, one per host, made on first use and kept (up to ``HOSTS_KEPT``,
    the least recently used dropped: its kept connections close as it is collected; a call
    still using it goes on)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._by_host: OrderedDict[str, httpx.Client] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, host: str) -> httpx.Client:
        with self._lock:
            client = self._by_host.get(host)
            if client is None:
                client = self._by_host[host] = _new_client()
                while len(self._by_host) > HOSTS_KEPT:
                    self._by_host.popitem(last=False)
            else:
                self._by_host.move_to_end(host)
            return client


def _new_client() -> httpx.Client:
    client = httpx.Client(
        follow_redirects=False,
        verify=_tls_context(),
        limits=httpx.Limits(
            max_connections=None,  # the tool pool's threads bound the calls at once
            max_keepalive_connections=KEEPALIVE_PER_HOST,
            keepalive_expiry=KEEPALIVE_SECONDS,
        ),
    )
    # httpx names no network backend of its own: every transport's pool (the proxies' too,
    # which the environment may configure) is given the one that shows connections to cutoffs.
    backend = _Backend()
    for transport in (client._transport, *client._mounts.values()):
        pool = getattr(transport, "_pool", None)
        if pool is not None:
            pool._network_backend = backend
    return client


class _ThisProcess:
    """What a process keeps for its exchanges, made afresh in a forked child."""

    def __init__(self) -> None:
        self.clients = Clients()
        self.clock = Clock()  # a fork leaves the parent's thread behind
        self.tls_lock = threading.Lock()  # one not held by a thread the fork left behind


_process = _ThisProcess()


def client_for(host: str) -> httpx.Client:
    """This process's client for ``host``; a forked child makes its own."""
    if _process.clients.pid != os.getpid():  # also done at the fork: see below
        _process.clients = Clients()
    return _process.clients.get(host.lower())


def _forget_clients() -> None:
    """In a forked child: the parent's clients (and any lock held as it forked) are left
    behind, never used nor closed (closing would not touch the parent's connections, but
    using one would share it)."""
    _process.__init__()  # type: ignore[misc]


os.register_at_fork(after_in_child=_forget_clients)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # the peer is gone already
        sock.shutdown(socket.SHUT_RDWR)


_tls: dict[int, ssl.SSLContext] = {}  # by process id


def _tls_context() -> ssl.SSLContext:
    """This process's TLS context (httpx's defaults), shared by every exchange: building one
    loads the CA bundle, tens of ms of CPU that each call would otherwise pay. A forked child
    builds its own."""
    with _process.tls_lock:
        context = _tls.get(os.getpid())
        if context is None:
            context = _tls[os.getpid()] = httpx.create_ssl_context()
        return context
