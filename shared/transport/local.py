"""The transport of ``ratchet dev``: one process, no Redis. The API, the worker and the
dispatcher share the process, so a wake-up is a call to a listener, the live view and the gate
are process memory, the limiter is ``LocalLimiter``, and the queue is kombu's in-memory
transport."""

from __future__ import annotations

import asyncio
import bisect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kombu.exceptions import ChannelError

from shared.deltas import LOG_MAX_ENTRIES, LOG_TTL_SECONDS, Delta, Piece, discarded_data
from shared.queue import get_celery
from shared.ratelimit.in_process import LocalLimiter
from shared.settings import Settings
from shared.transport.base import GATE_LANDING_SECONDS, Following, Listener, Transport


class Listeners:
    """Callbacks in this process, called on the caller's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: set[Listener] = set()

    def add(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.add(listener)

    def discard(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.discard(listener)

    def snapshot(self) -> list[Listener]:
        with self._lock:
            return list(self._listeners)


class LocalWaiter:
    """The dispatcher's wait: the process's own wake-ups."""

    def __init__(self, event: threading.Event) -> None:
        self._event = event

    def wait(self, timeout: float) -> bool:
        woken = self._event.wait(timeout)
        self._event.clear()
        return woken

    def close(self) -> None:
        """Nothing is held: the event belongs to the transport."""


class LocalFollowing:
    """The event hub's listener: a wake-up from any thread reaches the hub on its loop."""

    def __init__(
        self,
        listeners: Listeners,
        wake: Listener,
        *,
        delta_listeners: Listeners,
        wake_deltas: Listener | None,
    ) -> None:
        self._listeners = listeners
        self._delta_listeners = delta_listeners
        self._wake = wake
        self._wake_deltas = wake_deltas
        self._loop = asyncio.get_running_loop()
        listeners.add(self._from_thread)
        delta_listeners.add(self._deltas_from_thread)

    def _from_thread(self, task_id: str) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake, task_id)

    def _deltas_from_thread(self, task_id: str) -> None:
        if self._wake_deltas is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake_deltas, task_id)

    async def stop(self) -> None:
        self._listeners.discard(self._from_thread)
        self._delta_listeners.discard(self._deltas_from_thread)


@dataclass
class DeltaLog:
    """One task's delta log in memory: its entries (positions increasing), the call that
    wrote the last of them, and when it was last written (monotonic)."""

    entries: list[Delta] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    call: tuple[int, int] = (0, 0)
    touched: float = 0.0


class LocalDeltas:
    """Every task's delta log in this process, with the rules of ``shared.deltas``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logs: dict[str, DeltaLog] = {}
        self._pos = int(time.time() * 1000) * 1000  # positions go on rising across logs
        self._swept = time.monotonic()

    def append(self, piece: Piece) -> bool:
        """Append ``piece`` (and a discard entry before it, when due); False if refused."""
        now = time.monotonic()
        with self._lock:
            log = self._logs.setdefault(piece.task_id, DeltaLog())
            call = (piece.epoch, piece.attempt)
            last = log.entries[-1] if log.entries else None
            if last is not None and call < log.call:
                return False  # a call older than the one that wrote last
            partial = last is not None and last.kind == "delta" and last.step == piece.step
            if partial and call != log.call:
                reason = "retried" if piece.epoch == log.call[0] else "rerun"
                self._add(log, Delta(0, "discarded", piece.step, piece.after, ""), reason)
            self._add(log, Delta(0, "delta", piece.step, piece.after, piece.data))
            log.call, log.touched = call, now
            if now - self._swept > LOG_TTL_SECONDS:
                self._sweep(now)
        return True

    def _add(self, log: DeltaLog, delta: Delta, reason: str = "") -> None:
        self._pos += 1
        data = discarded_data(delta.step, reason) if delta.kind == "discarded" else delta.data
        log.entries.append(Delta(self._pos, delta.kind, delta.step, delta.after, data))
        log.positions.append(self._pos)
        if len(log.entries) > LOG_MAX_ENTRIES:
            del log.entries[0], log.positions[0]

    def _sweep(self, now: float) -> None:
        self._swept = now
        for task_id in [t for t, log in self._logs.items() if now - log.touched > LOG_TTL_SECONDS]:
            del self._logs[task_id]

    def read(self, task_id: str, *, after: int, limit: int) -> list[Delta]:
        with self._lock:
            log = self._logs.get(task_id)
            if log is None:
                return []
            start = bisect.bisect_right(log.positions, after)
            return log.entries[start : start + limit]


class LocalPresence:
    """The live view in process memory: records that expire on the monotonic clock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, tuple[str, float, float]] = {}  # member → (record, seen, expiry)
        self._sweep: str | None = None

    def put(self, member: str, record: str, *, seen_at: float, ttl_seconds: float) -> None:
        with self._lock:
            self._records[member] = (record, seen_at, time.monotonic() + ttl_seconds)

    def remove(self, member: str) -> None:
        with self._lock:
            self._records.pop(member, None)

    def records(self, limit: int) -> list[str | bytes]:
        now = time.monotonic()
        with self._lock:
            for member in [m for m, (_, _, expiry) in self._records.items() if expiry <= now]:
                del self._records[member]
            newest = sorted(self._records.values(), key=lambda entry: entry[1], reverse=True)
        return [record for record, _, _ in newest[:limit]]

    def put_sweep(self, record: str) -> None:
        with self._lock:
            self._sweep = record

    def sweep(self) -> str | None:
        with self._lock:
            return self._sweep


class LocalTransport(Transport):
    """Everything in this process's memory: one per process, for as long as it lives."""

    name = "local"

    def __init__(self) -> None:
        self._readers = Listeners()
        self._delta_readers = Listeners()
        self._deltas = LocalDeltas()
        self._cancels = Listeners()
        self._dispatch = threading.Event()
        self._lock = threading.Lock()
        self._presences: dict[str, LocalPresence] = {}
        self._gates: dict[str, tuple[int, float]] = {}  # key → (slots, monotonic closing time)
        self._in_flight: dict[str, tuple[int, float]] = {}  # key → (slots taken, not landed; until)
        self._limiter = LocalLimiter()

    def broker_options(self, settings: Settings) -> dict[str, float]:
        # The in-memory transport polls; its default (1 s) would add a second to every step.
        return {"polling_interval": 0.01}

    def queue_depth(self, queue: str) -> int | None:
        with get_celery().connection_for_read() as connection:
            channel: Any = connection.default_channel
            try:
                declared = channel.queue_declare(queue=queue, passive=True)
            except ChannelError:
                return 0  # not declared yet: nothing was ever sent to it
        return int(declared.message_count)

    def oldest_message(self, queue: str) -> bytes | None:
        return None  # kombu's in-memory queues cannot be looked into

    def wake_readers(self, task_ids: Iterable[str]) -> None:
        listeners = self._readers.snapshot()
        for task_id in task_ids:
            for listener in listeners:
                listener(task_id)

    def wake_dispatcher(self, queue_name: str) -> None:
        self._dispatch.set()  # one process, one dispatcher

    def dispatcher_waiter(self, queue_name: str) -> LocalWaiter:
        return LocalWaiter(self._dispatch)

    def wake_cancel(self, task_id: str) -> None:
        for listener in self._cancels.snapshot():
            listener(task_id)

    def follow_readers(
        self,
        wake: Listener,
        *,
        wake_all: Callable[[], None],
        log: logging.Logger,
        wake_deltas: Listener | None = None,
    ) -> Following:
        # Calls, never lost: no gap to make up.
        return LocalFollowing(
            self._readers, wake, delta_listeners=self._delta_readers, wake_deltas=wake_deltas
        )

    def append_deltas(self, pieces: Sequence[Piece]) -> bool:
        woken = {piece.task_id for piece in pieces if self._deltas.append(piece)}
        listeners = self._delta_readers.snapshot()
        for task_id in woken:
            for listener in listeners:
                listener(task_id)
        return True

    def read_deltas(self, task_id: str, *, after: int, limit: int) -> list[Delta]:
        return self._deltas.read(task_id, after=after, limit=limit)

    def follow_cancels(self, cancel: Listener, *, log: logging.Logger) -> None:
        self._cancels.add(cancel)  # the API's cancel calls the step's watch directly

    def presence(self, name: str) -> LocalPresence:
        with self._lock:
            return self._presences.setdefault(name, LocalPresence())

    def reset_gate(self, key: str, slots: int, *, ttl_seconds: float) -> int:
        now = time.monotonic()
        with self._lock:
            if slots > 0:
                self._gates[key] = (slots, now + ttl_seconds)
            else:
                self._gates.pop(key, None)
            return self._flying(key, now)

    def take_gate_slot(self, key: str) -> bool:
        now = time.monotonic()
        with self._lock:
            slots, until = self._gates.get(key, (0, 0.0))
            if slots <= 0 or until <= now:
                return False
            self._gates[key] = (slots - 1, until)
            self._in_flight[key] = (self._flying(key, now) + 1, now + GATE_LANDING_SECONDS)
            return True

    def land_gate_slot(self, key: str) -> None:
        now = time.monotonic()
        with self._lock:
            flying = self._flying(key, now)
            if flying > 0:
                self._in_flight[key] = (flying - 1, self._in_flight[key][1])

    def _flying(self, key: str, now: float) -> int:
        count, until = self._in_flight.get(key, (0, 0.0))
        return count if until > now else 0

    def limiter(self) -> LocalLimiter:
        return self._limiter

    def readiness(self) -> dict[str, str]:
        return {}  # nothing outside the process to wait for
