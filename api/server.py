"""How Ratchet serves its API: uvicorn, with limits that keep a hostile client from hurting
anyone else. ``ratchet api`` and ``ratchet dev`` both serve through :func:`serve`.

uvicorn caps neither the size of a request head on its httptools parser nor the time a head
may take to arrive, so :class:`GuardedHttpProtocol` adds both: a head over
``api_max_header_bytes`` or ``api_max_headers`` is refused with a 431 before it is parsed
(one 100 MB header would otherwise be buffered and re-copied for seconds, stalling the
event loop), and a connection whose head is not complete within ``api_header_timeout_seconds``
(or whose body is not within ``api_body_timeout_seconds``) is dropped, so a slowloris client
holds nothing for long.

Connections are bounded so that no client can lock the others out alone. One client address
holds at most ``api_max_connections_per_client`` connections at once (a trusted proxy,
``api_trusted_proxies``, is exempt: it speaks for many clients, and its X-Forwarded-For is
believed); and ``api_max_connections`` counts requests in progress, not connections: one still
sending its head, or idle between requests, is not counted (the header and keep-alive
timeouts end those), so half-open connections never turn away a request whose head arrived.
"""

from __future__ import annotations

import json
import logging
from asyncio import TimerHandle
from collections import Counter
from functools import cache
from ipaddress import ip_address, ip_network
from typing import Any

import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from shared.settings import Settings, get_settings

log = logging.getLogger("ratchet.api.server")
HEAD_END = b"\r\n\r\n"
BUSY_RETRY_AFTER_SECONDS = 1
# Open connections of each client address in this process (the event loop is the only writer).
open_by_client: Counter[str] = Counter()


def _problem_body(status: int, title: str, detail: str) -> bytes:
    return json.dumps(
        {
            "type": f"urn:ratchet:problem:{title.lower().replace(' ', '-')}",
            "title": title,
            "status": status,
            "detail": detail,
        }
    ).encode()


def _problem(status: int, title: str, detail: str) -> bytes:
    """A complete ``Connection: close`` response with a problem+json body."""
    body = _problem_body(status, title, detail)
    head = (
        f"HTTP/1.1 {status} {title}\r\ncontent-type: application/problem+json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


@cache
def _trusted(proxies: tuple[str, ...]) -> tuple[Any, ...]:
    return tuple(ip_network(p, strict=False) for p in proxies if p != "*")


def is_trusted_proxy(host: str, proxies: list[str]) -> bool:
    """Whether ``host`` (a peer's address) is one of ``api_trusted_proxies``."""
    if "*" in proxies:
        return True
    try:
        address = ip_address(host)
    except ValueError:
        return False  # a Unix socket's peer, or no address at all
    return any(address in network for network in _trusted(tuple(proxies)))


async def over_capacity(scope: Scope, receive: Receive, send: Send) -> None:
    """The answer to a request past ``api_max_connections``: a 503 problem with Retry-After."""
    detail = "the server is serving its most requests at once; retry shortly"
    body = _problem_body(503, "Service Unavailable", detail)
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/problem+json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(BUSY_RETRY_AFTER_SECONDS).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a cap on the request head and read timeouts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = get_settings()
        self._max_head_bytes = settings.api_max_header_bytes
        self._max_head_lines = settings.api_max_headers + 2  # the request line, the blank line
        self._header_timeout = settings.api_header_timeout_seconds
        self._body_timeout = settings.api_body_timeout_seconds
        self._max_requests = settings.api_max_connections
        self._max_per_client = settings.api_max_connections_per_client
        self._proxies = settings.api_trusted_proxies
        self._client: str | None = None  # the address counted in open_by_client, if any
        self._in_head = True
        self._head_bytes = 0
        self._head_lines = 0
        self._tail = b""  # the last bytes seen, for a head end split across reads
        self._read_timer: TimerHandle | None = None

    # -- the request head -------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm(self._header_timeout)
        peer = transport.get_extra_info("peername")
        host = peer[0] if isinstance(peer, tuple) and peer else ""
        if not host or is_trusted_proxy(host, self._proxies):
            return
        if open_by_client[host] >= self._max_per_client:
            detail = (
                f"this client holds {self._max_per_client} connections open, its most; "
                "reuse one, or close one first"
            )
            self._refuse(_problem(429, "Too Many Requests", detail))
            return
        self._client = host
        open_by_client[host] += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._client is not None:
            open_by_client[self._client] -= 1
            if not open_by_client[self._client]:
                del open_by_client[self._client]
            self._client = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head and not self._head_within_limits(data):
            self._refuse(
                _problem(431, "Request Header Fields Too Large", self._head_limit_detail())
            )
            return
        super().data_received(data)

    def _head_within_limits(self, data: bytes) -> bool:
        """Count the bytes and lines of the head in ``data`` (up to its end, if it ends here)."""
        seen = self._tail + data
        end = seen.find(HEAD_END)
        head = data if end < 0 else data[: max(0, end + len(HEAD_END) - len(self._tail))]
        self._head_bytes += len(head)
        self._head_lines += head.count(b"\n")
        self._tail = seen[-(len(HEAD_END) - 1) :]
        return self._head_bytes <= self._max_head_bytes and self._head_lines <= self._max_head_lines

    def _head_limit_detail(self) -> str:
        return (
            f"the request line and headers are over the limit of {self._max_head_bytes} bytes "
            f"or {self._max_head_lines - 2} headers"
        )

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self._body_timeout)
        if len(self.tasks) < self._max_requests:
            super().on_headers_complete()
            return
        # uvicorn starts the request with ``self.app``, read once as it does: this request
        # alone is answered by over_capacity.
        app, self.app = self.app, over_capacity
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head, self._head_bytes, self._head_lines, self._tail = True, 0, 0, b""
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:
            self._arm(self._header_timeout)  # the next request's head, if one comes

    # -- timeouts ---------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self._in_head and (self.cycle is None or self.cycle.response_complete):
            detail = "the request line and headers did not arrive in time"
            self._refuse(_problem(408, "Request Timeout", detail))
        else:
            # The body is late: the app sees a disconnect, and answers nothing. One line says
            # why (the client's own address is for the proxy's log, not this one).
            log.warning(
                "dropped a request whose body did not arrive within %s s", self._body_timeout
            )
            self.transport.close()

    def _refuse(self, response: bytes) -> None:
        self._disarm()
        self.transport.write(response)
        self.transport.close()


def serve(*, host: str, port: int, workers: int = 1, log_level: str | None = None) -> None:
    """Serve ``api.main:create_app`` with the limits of ``settings``, until stopped."""
    settings = get_settings()
    uvicorn.run(
        "api.main:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level=log_level,
        log_config=None,  # uvicorn's records go through Ratchet's handler (RATCHET_LOG_FORMAT)
        **limits(settings),
    )


def limits(settings: Settings) -> dict[str, Any]:
    """uvicorn's own knobs for the server-wide limits. ``api_max_connections`` is not its
    ``limit_concurrency``, which counts every open connection, half-open ones included: the
    protocol applies it to requests in progress."""
    return {
        "http": GuardedHttpProtocol,
        "backlog": settings.api_backlog,
        "timeout_keep_alive": settings.api_keep_alive_seconds,
        # Open SSE streams end at SIGTERM (api/shutdown.py); anything else still running this
        # long after it is cancelled, so a stop never waits without bound.
        "timeout_graceful_shutdown": settings.api_shutdown_grace_seconds,
        "proxy_headers": bool(settings.api_trusted_proxies),
        "forwarded_allow_ips": settings.api_trusted_proxies or None,
    }
