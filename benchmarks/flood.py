"""The connection flood: many unauthenticated connections to the API that each send part of a
request head, a header line every few seconds, and never finish it. Each is renewed before
the server's header timeout would end it (its successor opened first), and one the server
closes (or answers with a 503) is opened again at its next turn. Bounded: ``connections`` at
most, from one loopback address, ended by ``stop`` or by ``max_seconds``, whichever comes
first; every connection is closed at the end.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, ClassVar

from benchmarks.hostile import FLOOD_SOURCE

HEAD = b"GET /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\n"
LINE = b"X-Slow: 1\r\n"
LINE_SECONDS = 5.0
RENEW_SECONDS = 0.5
RENEW_AFTER_SECONDS = 8.0  # the API's default header timeout is 10 s
CONNECT_SECONDS = 5.0
RAMP_SECONDS = 8.0  # the connections open spread over this, not all in one burst


@dataclass
class ConnectionFlood:
    """``connections`` half-open connections to the API, held while the load lasts."""

    connections: int = 2100
    max_seconds: float = 300.0
    name: ClassVar[str] = "conn-flood"
    settle_seconds: float = RAMP_SECONDS + 2.0
    counts: dict[str, int] = field(
        default_factory=lambda: {"opened": 0, "refused": 0, "closed_by_server": 0, "open": 0}
    )
    peak_open: int = 0
    writers: set[asyncio.StreamWriter] = field(default_factory=set)

    def start(self, api: str, key: str) -> None:
        host, port = api.removeprefix("http://").rsplit(":", 1)
        self.address = (host, int(port))
        self.ready = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def stop(self) -> dict[str, Any]:
        with suppress(RuntimeError):  # its loop has closed: max_seconds ended it already
            self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(timeout=30)
        return {"connections": self.connections, "peak_open": self.peak_open, **self.counts}

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        self.ready.set()
        holders = [asyncio.create_task(self._hold(i)) for i in range(self.connections)]
        with suppress(TimeoutError):  # max_seconds: the flood ends even if nobody stops it
            await asyncio.wait_for(self.stopping.wait(), self.max_seconds)
        for holder in holders:
            holder.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
        for writer in list(self.writers):
            self._close(writer)

    async def _hold(self, index: int) -> None:
        """Hold one connection for good: every ``RENEW_AFTER_SECONDS`` (before a header
        timeout would end it) the next one is opened before the last is closed. One the
        server lets go of early is opened again at its next turn, not at once: the flood stays
        at most one connection attempt per ``RENEW_AFTER_SECONDS`` each, like the client it
        stands for, rather than becoming a reconnect storm."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(index * RAMP_SECONDS / self.connections)
        previous: asyncio.StreamWriter | None = None
        while True:
            turn = loop.time()
            opened = await self._open()
            if previous is not None:
                self._close(previous)
                previous = None
            if opened is not None:
                try:
                    let_go = await self._dribble(*opened)
                except OSError:
                    let_go = True
                if not let_go:
                    previous = opened[1]
                    continue
                self.counts["closed_by_server"] += 1
                self._close(opened[1])
            await asyncio.sleep(max(RENEW_SECONDS, turn + RENEW_AFTER_SECONDS - loop.time()))

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        try:
            opened = await asyncio.wait_for(
                asyncio.open_connection(*self.address, local_addr=(FLOOD_SOURCE, 0)),
                CONNECT_SECONDS,
            )
        except (OSError, TimeoutError):
            self.counts["refused"] += 1
            return None
        self._count_open(+1)
        self.writers.add(opened[1])
        return opened

    def _close(self, writer: asyncio.StreamWriter) -> None:
        self._count_open(-1)
        self.writers.discard(writer)
        writer.close()

    async def _dribble(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Send the head's start, then a header line every ``LINE_SECONDS``, for
        ``RENEW_AFTER_SECONDS``; whether the server let go first (answered, or closed)."""
        renew_at = asyncio.get_running_loop().time() + RENEW_AFTER_SECONDS
        writer.write(HEAD)
        while (left := renew_at - asyncio.get_running_loop().time()) > 0:
            await writer.drain()
            try:
                await asyncio.wait_for(reader.read(1024), min(LINE_SECONDS, left))
                return True  # an answer (a 408 or 503) or the end
            except TimeoutError:
                writer.write(LINE)
        return False

    def _count_open(self, change: int) -> None:
        if change > 0:
            self.counts["opened"] += 1
        self.counts["open"] += change
        self.peak_open = max(self.peak_open, self.counts["open"])
