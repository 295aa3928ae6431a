"""The transport of ``ratchet dev``: one process, no Redis. The API, the worker and the
dispatcher share the process, so a wake-up is a call to a listener, the live view and the gate
are process memory, the limiter is ``LocalLimiter``, and the queue is kombu's in-memory
transport."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kombu.exceptions import ChannelError

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

    def __init__(self, listeners: Listeners, wake: Listener) -> None:
        self._listeners = listeners
        self._wake = wake
        self._loop = asyncio.get_running_loop()
        listeners.add(self._from_thread)

    def _from_thread(self, task_id: str) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake, task_id)

    async def stop(self) -> None:
        self._listeners.discard(self._from_thread)


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
        self, wake: Listener, *, wake_all: Callable[[], None], log: logging.Logger
    ) -> Following:
        return LocalFollowing(self._readers, wake)  # calls, never lost: no gap to make up

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
