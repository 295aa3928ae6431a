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
"""

from __future__ import annotations

import codecs
import contextlib
import os
import socket
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

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
    with (
        httpx.Client(timeout=seconds, follow_redirects=False, verify=_tls_context()) as client,
        Cutoff(seconds) as cutoff,
    ):
        try:
            with pinned_stream(
                client,
                destination,
                method=method,
                headers=headers,
                json=json,
                extensions={"trace": cutoff.trace},
            ) as response:
                body, truncated = read_capped(response)
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

    The socket is learnt from httpx's ``trace`` extension as the connection is made, and kept
    as a duplicate descriptor of its own: shutting that down ends the connection under the
    exchange's reads, TLS or not (a TLS socket takes the plain one's descriptor over), and it
    can never be another connection's, as a descriptor closed by httpx and opened again
    could. It is closed when the exchange ends."""

    def __init__(self, seconds: float) -> None:
        self.fired = False
        self._socket: socket.socket | None = None
        self._over = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def __enter__(self) -> Cutoff:
        self._timer.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._timer.cancel()
        with self._lock:
            self._over = True
            if self._socket is not None:
                self._socket.close()

    def trace(self, event: str, info: Mapping[str, Any]) -> None:
        """httpx's trace hook: note the connection's socket as it is made."""
        if event != "connection.connect_tcp.complete" or info.get("return_value") is None:
            return
        made = info["return_value"].get_extra_info("socket")
        with self._lock:
            if self._socket is not None:
                self._socket.close()
            self._socket = made.dup()
            if self.fired:  # connected just as the deadline passed
                _shut(self._socket)

    def _fire(self) -> None:
        with self._lock:
            if self._over:
                return
            self.fired = True
            if self._socket is not None:
                _shut(self._socket)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # the peer is gone already
        sock.shutdown(socket.SHUT_RDWR)


_tls: dict[int, ssl.SSLContext] = {}  # by process id
_tls_lock = threading.Lock()


def _tls_context() -> ssl.SSLContext:
    """This process's TLS context (httpx's defaults), shared by every exchange: building one
    loads the CA bundle, tens of ms of CPU that each call would otherwise pay. A forked child
    builds its own."""
    with _tls_lock:
        context = _tls.get(os.getpid())
        if context is None:
            context = _tls[os.getpid()] = httpx.create_ssl_context()
        return context
