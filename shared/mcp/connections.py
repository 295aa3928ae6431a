"""One client session per MCP server and process, on one background event loop per process.

The MCP SDK is asynchronous and Ratchet's steps run on threads: each process that uses a
server (a worker's prefork child, an API process) gets one asyncio loop on a thread of its
own, made on first use and made again in a forked child (a child must not share its parent's
loop, nor the pipes of its parent's stdio servers). A step's thread hands its call to that loop
and waits for the answer (:func:`call_tool`).

Each server has one long-lived session per process. A stdio server is a child of the process,
started on first use and started again on the next call after it died; :func:`starts` counts
the starts, so that one start per process can be checked. The session speaks the MCP
handshake protocol (``initialize``), which every server speaks, and listens for
``notifications/tools/list_changed``, which marks its tool list stale.

The call carries the ledger's idempotency key in its ``_meta`` as ``ratchet/idempotency_key``
(:data:`IDEMPOTENCY_META_KEY`). What can go wrong is told apart by whether the request was
sent: a server that cannot be started or reached, or whose URL the egress policy refuses, is a
:class:`~shared.errors.ToolError` (nothing happened); a server that died, failed or did not
answer within its timeout once the request was sent is a
:class:`~shared.errors.ToolOutcomeUnknown` (it may have acted).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import httpx2
import mcp_types as types
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage

from shared.errors import EgressDenied, ToolError, ToolOutcomeUnknown
from shared.mcp.config import ServerConfig
from shared.webhooks.egress import check_url

log = logging.getLogger("ratchet.mcp")
T = TypeVar("T")

IDEMPOTENCY_META_KEY = "ratchet/idempotency_key"
_LIST_PAGES = 100  # a server whose tool list never ends is cut here


@dataclass(frozen=True)
class Listing:
    """A server's tools as it last listed them, and when (``time.monotonic``)."""

    tools: tuple[types.Tool, ...]
    at: float


@dataclass
class _Call:
    """Where a call got to: once ``sent``, its outcome is the server's to tell."""

    sent: bool = False


class Link:
    """This process's session with one server: connected on demand, again after it ended."""

    def __init__(self, name: str, config: ServerConfig) -> None:
        self.name = name
        self.config = config
        self.starts = 0
        self.listing: Listing | None = None
        self.stale = False  # the server said its tools changed
        self._client: Client | None = None
        self._ended: asyncio.Event | None = None
        self._connecting: asyncio.Future[Client] | None = None
        self._holder: asyncio.Task[None] | None = None

    async def client(self) -> Client:
        """The live session, connecting first if there is none (or it ended). Callers that
        stop waiting (their timeout) leave the connect to finish for the next caller: a
        stdio server is started once, however many calls wait for it."""
        if self._client is not None and self._ended is not None and not self._ended.is_set():
            return self._client
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.get_running_loop().create_future()
            self._holder = asyncio.create_task(self._hold(self._connecting), name=self.name)
        return await asyncio.shield(self._connecting)

    def drop(self) -> None:
        """Forget the session: the next call connects again (and a stdio server restarts)."""
        if self._ended is not None:
            self._ended.set()

    async def close(self) -> None:
        self.drop()
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
            if self._holder is not None:
                self._holder.cancel()  # still starting: stop (its transport ends the process)
        if self._holder is not None:
            await asyncio.gather(self._holder, return_exceptions=True)

    async def _hold(self, ready: asyncio.Future[Client]) -> None:
        """Enter the session, make it the live one, and hold it until it ends (the SDK's
        transports must be entered and left by one task)."""
        ended = asyncio.Event()
        try:
            transport = self._transport(ended)
            if self.config.transport == "stdio":
                self.starts += 1
                log.info("starting MCP server %s (start %d here)", self.name, self.starts)
            client = Client(
                transport,
                mode="legacy",
                cache=None,
                message_handler=self._on_message,
                client_info=types.Implementation(name="ratchet", version="1"),
            )
            async with asyncio.timeout(self.config.timeout_seconds):
                await client.__aenter__()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
                ready.exception()  # retrieved: a caller that stopped waiting is not told
            if not isinstance(exc, Exception):
                raise
            return
        try:
            self.stale = True  # a new session: list again (the server may have changed)
            self._client, self._ended = client, ended
            if not ready.done():
                ready.set_result(client)
            await ended.wait()
        finally:
            try:
                await client.__aexit__(None, None, None)
            except Exception as exc:  # a dead server's transport may fail to close cleanly
                log.debug("closing the session with MCP server %s: %s", self.name, exc)

    def _transport(self, ended: asyncio.Event) -> Any:
        config = self.config
        if config.command is not None:
            params = StdioServerParameters(
                command=config.command, args=list(config.args), env=config.env, cwd=config.cwd
            )
            return _watched(stdio_client(params, errlog=sys.stderr), ended)
        assert config.url is not None
        return _watched(_http_transport(config.url, config.headers), ended)

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            self.stale = True


@asynccontextmanager
async def _watched(transport: Any, ended: asyncio.Event) -> AsyncIterator[Any]:
    """``transport``'s streams, its read stream watched: when the server goes away (a stdio
    server's output ends, an HTTP session closes) ``ended`` is set, and the next call
    connects again."""
    async with transport as (read_stream, write_stream):
        yield _EndWatch(read_stream, ended), write_stream
    ended.set()


class _EndWatch:
    """A read stream that sets an event when it ends."""

    def __init__(self, stream: Any, ended: asyncio.Event) -> None:
        self._stream = stream
        self._ended = ended

    async def receive(self) -> SessionMessage | Exception:
        try:
            item: SessionMessage | Exception = await self._stream.receive()
        except BaseException:
            self._ended.set()
            raise
        return item

    async def aclose(self) -> None:
        await self._stream.aclose()

    def __aiter__(self) -> _EndWatch:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except Exception as exc:  # anyio's EndOfStream, or a closed stream
            raise StopAsyncIteration from exc

    async def __aenter__(self) -> _EndWatch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._ended.set()
        await self._stream.__aexit__(*exc)

    def __getattr__(self, name: str) -> Any:  # e.g. the SDK's ``last_context``
        return getattr(self._stream, name)


@asynccontextmanager
async def _http_transport(url: str, headers: dict[str, str]) -> AsyncIterator[Any]:
    """The Streamable HTTP transport on a client of our own: the egress policy vets the URL
    and every connection goes to the address it vetted (the Host header and TLS server name
    stay the URL's host)."""
    from shared.settings import get_settings

    destination = check_url(url, allowed_hosts=get_settings().http_allowed_hosts)
    transport = _PinnedTransport(destination.address, destination.host)
    client = httpx2.AsyncClient(
        headers=headers, transport=transport, timeout=httpx2.Timeout(30.0, read=300.0)
    )
    async with client, streamable_http_client(url, http_client=client) as streams:
        yield streams


class _PinnedTransport(httpx2.AsyncHTTPTransport):
    """Connects to ``address`` (when the policy pinned one) whatever the URL's host."""

    def __init__(self, address: str | None, host: str) -> None:
        super().__init__()
        self._address = address
        self._host = host

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if self._address is not None and request.url.host == self._host:
            ip = self._address
            request.url = request.url.copy_with(host=f"[{ip}]" if ":" in ip else ip)
            request.extensions = {**request.extensions, "sni_hostname": self._host}
        return await super().handle_async_request(request)


# -- the process's loop and links -------------------------------------------------------------


@dataclass
class _Process:
    """One process's loop thread and its links, by server name."""

    loop: asyncio.AbstractEventLoop
    links: dict[str, Link] = field(default_factory=dict)


_processes: dict[int, _Process] = {}
_lock = threading.Lock()


def _process() -> _Process:
    """This process's loop, started on first use (a forked child starts one of its own)."""
    pid = os.getpid()
    found = _processes.get(pid)
    if found is not None:
        return found
    with _lock:
        found = _processes.get(pid)
        if found is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="mcp-loop", daemon=True)
            thread.start()
            found = _processes[pid] = _Process(loop)
    return found


def _link(name: str, config: ServerConfig) -> Link:
    """The link to ``name`` as ``config`` declares it (a changed declaration gets a new one)."""
    process = _process()
    with _lock:
        link = process.links.get(name)
        if link is None or link.config != config:
            if link is not None:
                process.loop.call_soon_threadsafe(link.drop)
            link = process.links[name] = Link(name, config)
    return link


def _run(coro: Coroutine[Any, Any, T], *, timeout: float) -> T:
    """Run ``coro`` on this process's loop and wait for it, at most ``timeout`` s (then it
    is cancelled there and TimeoutError raised here)."""
    process = _process()

    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await coro

    future = asyncio.run_coroutine_threadsafe(bounded(), process.loop)
    try:
        return future.result(timeout + 5)  # the loop's own timeout comes first
    except concurrent.futures.TimeoutError as exc:
        future.cancel()
        raise TimeoutError from exc


# -- what the rest of Ratchet calls --------------------------------------------------------------


def call_tool(
    server: str,
    tool: str,
    arguments: dict[str, Any],
    *,
    config: ServerConfig,
    idempotency_key: str,
    timeout: float | None = None,
) -> types.CallToolResult:
    """Call ``tool`` on ``server`` from any thread and return the server's result.

    Raises ToolError when the request was never sent (the server cannot be started or
    reached, or the egress policy refuses it), ToolOutcomeUnknown when it was sent and no
    answer came (the server died, failed or ran past ``timeout``, by default its own).
    """
    link = _link(server, config)
    limit = timeout if timeout is not None else config.timeout_seconds
    call = _Call()
    try:
        return _run(_call(link, tool, arguments, idempotency_key, call), timeout=limit)
    except TimeoutError:
        if call.sent:
            raise ToolOutcomeUnknown(
                f"MCP server {server!r} did not answer {tool} within {limit:g} s"
            ) from None
        raise ToolError(f"MCP server {server!r} did not start within {limit:g} s") from None


async def _call(
    link: Link, tool: str, arguments: dict[str, Any], key: str, call: _Call
) -> types.CallToolResult:
    try:
        return await _send(link, tool, arguments, key, call)
    except _SessionExpired:
        # The server refused the session, not the call (an HTTP server that restarted):
        # nothing ran, and a new session may send it.
        link.drop()
        return await _send(link, tool, arguments, key, call)


class _SessionExpired(Exception):
    """An HTTP server no longer knows the session: the request was not processed."""


def _expired(exc: MCPError, link: Link) -> bool:
    return (
        link.config.transport == "http"
        and exc.code == types.INVALID_REQUEST
        and "session" in str(exc).lower()
    )


async def _send(
    link: Link, tool: str, arguments: dict[str, Any], key: str, call: _Call
) -> types.CallToolResult:
    client = await _connected(link)
    call.sent = True
    try:
        meta = cast(types.RequestParamsMeta, {IDEMPOTENCY_META_KEY: key})  # an open map
        return await client.call_tool(tool, arguments, meta=meta)
    except MCPError as exc:
        if _expired(exc, link):
            raise _SessionExpired from exc
        if exc.code == types.CONNECTION_CLOSED:
            link.drop()
            raise ToolOutcomeUnknown(
                f"MCP server {link.name!r} went away during the call to {tool}"
            ) from exc
        raise ToolError(f"MCP server {link.name!r} refused the call to {tool}: {exc}") from exc
    except (ToolError, asyncio.CancelledError):
        raise
    except Exception as exc:
        link.drop()
        raise ToolOutcomeUnknown(
            f"MCP server {link.name!r} failed during the call to {tool}: {describe(exc)}"
        ) from exc


async def _connected(link: Link) -> Client:
    try:
        return await link.client()
    except EgressDenied as exc:
        raise ToolError(f"MCP server {link.name!r}: {exc}") from exc
    except asyncio.CancelledError:
        raise
    except TimeoutError as exc:
        limit = link.config.timeout_seconds
        raise ToolError(f"MCP server {link.name!r} did not start within {limit:g} s") from exc
    except BaseException as exc:
        found = _leaf(exc)
        if isinstance(found, EgressDenied):
            raise ToolError(f"MCP server {link.name!r}: {found}") from exc
        raise ToolError(f"MCP server {link.name!r} is unavailable: {describe(exc)}") from exc


def listed_within(server: str, *, config: ServerConfig, max_age: float) -> bool:
    """Whether :func:`list_tools` would answer from this process's list, without waiting."""
    link = _link(server, config)
    listing = link.listing
    return listing is not None and not link.stale and time.monotonic() - listing.at < max_age


def list_tools(
    server: str, *, config: ServerConfig, max_age: float, timeout: float | None = None
) -> tuple[types.Tool, ...]:
    """``server``'s tools: as listed within ``max_age`` s and not changed since, or listed
    now (waiting at most ``timeout`` s, by default the server's). Raises ToolError when the
    server cannot be listed and never was: a list that cannot be refreshed is kept, and
    asked again next time."""
    link = _link(server, config)
    listing = link.listing
    if listing is not None and listed_within(server, config=config, max_age=max_age):
        return listing.tools
    limit = config.timeout_seconds if timeout is None else min(timeout, config.timeout_seconds)
    try:
        return _run(_list(link), timeout=limit).tools
    except (ToolError, TimeoutError) as exc:
        if listing is not None:
            log.warning("MCP server %s could not list its tools again: %s", server, exc)
            return listing.tools
        if isinstance(exc, TimeoutError):
            raise ToolError(
                f"MCP server {server!r} did not list its tools within {limit:g} s"
            ) from None
        raise


async def _list(link: Link) -> Listing:
    client = await _connected(link)
    link.stale = False  # a change notified from here on marks this listing stale again
    tools: list[types.Tool] = []
    cursor: str | None = None
    try:
        for _ in range(_LIST_PAGES):
            page = await client.list_tools(cursor=cursor)
            tools.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                break
    except Exception as exc:
        link.drop()
        raise ToolError(f"MCP server {link.name!r} could not list its tools: {exc}") from exc
    link.listing = Listing(tuple(tools), time.monotonic())
    return link.listing


def starts(server: str) -> int:
    """How many times this process started ``server`` (stdio servers; 0 for HTTP ones)."""
    process = _processes.get(os.getpid())
    link = process.links.get(server) if process is not None else None
    return 0 if link is None else link.starts


def close_all() -> None:
    """End this process's sessions (its stdio servers exit), e.g. before a test changes them."""
    process = _processes.get(os.getpid())
    if process is None:
        return
    with _lock:
        links = list(process.links.values())
        process.links.clear()

    async def close() -> None:
        await asyncio.gather(*(link.close() for link in links), return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(close(), process.loop).result(30)
    except TimeoutError:
        log.warning("MCP sessions still closing after 30 s; left to end on their own")


def describe(exc: BaseException) -> str:
    """An exception as one line: the first real error of an exception group."""
    found = _leaf(exc)
    text = str(found) or type(found).__name__
    return " ".join(text.split())


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
