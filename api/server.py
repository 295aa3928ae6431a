"""How Ratchet serves its API: uvicorn, with limits that keep a hostile client from hurting
anyone else. ``ratchet api`` and ``ratchet dev`` both serve through :func:`serve`.

uvicorn caps neither the size of a request head on its httptools parser nor the time a head
may take to arrive, so :class:`GuardedHttpProtocol` adds both: a head over
``api_max_header_bytes`` or ``api_max_headers`` is refused with a 431 before it is parsed
(one 100 MB header would otherwise be buffered and re-copied for seconds, stalling the
event loop), and a connection whose head is not complete within ``api_header_timeout_seconds``
(or whose body is not within ``api_body_timeout_seconds``) is dropped, so a slowloris client
holds nothing for long.
"""

from __future__ import annotations

import json
from asyncio import TimerHandle
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from shared.settings import Settings, get_settings

HEAD_END = b"\r\n\r\n"


def _problem(status: int, title: str, detail: str) -> bytes:
    """A complete ``Connection: close`` response with a problem+json body."""
    body = json.dumps(
        {
            "type": f"urn:ratchet:problem:{title.lower().replace(' ', '-')}",
            "title": title,
            "status": status,
            "detail": detail,
        }
    ).encode()
    head = (
        f"HTTP/1.1 {status} {title}\r\ncontent-type: application/problem+json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a cap on the request head and read timeouts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = get_settings()
        self._max_head_bytes = settings.api_max_header_bytes
        self._max_head_lines = settings.api_max_headers + 2  # the request line, the blank line
        self._header_timeout = settings.api_header_timeout_seconds
        self._body_timeout = settings.api_body_timeout_seconds
        self._in_head = True
        self._head_bytes = 0
        self._head_lines = 0
        self._tail = b""  # the last bytes seen, for a head end split across reads
        self._read_timer: TimerHandle | None = None

    # -- the request head -------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm(self._header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
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
        super().on_headers_complete()

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
            self.transport.close()  # the body is late: the app sees a disconnect

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
    """uvicorn's own knobs for the server-wide limits."""
    return {
        "http": GuardedHttpProtocol,
        "limit_concurrency": settings.api_max_connections,
        "backlog": settings.api_backlog,
        "timeout_keep_alive": settings.api_keep_alive_seconds,
    }
