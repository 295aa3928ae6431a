"""One subscription per API process to the event wake-ups, fanned out to waiting requests.

SSE streams and long polls wait on an asyncio.Event per task instead of each holding a
Redis connection; the hub sets the events of a task when a wake-up for it arrives (the
transport's subscription: ``shared.transport``, which resubscribes after an outage). A stream
that shows live deltas watches with :meth:`EventHub.watch_live`: woken by new deltas as well,
it is told which kind woke it, so it reads the database only for committed events. When the
process is stopping, :meth:`EventHub.close` wakes every one of them for good: ``closing`` tells
a stream to end (with a last event saying so) instead of waiting on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from shared.transport import get_transport
from shared.transport.base import Following

log = logging.getLogger("ratchet.api.events")


@dataclass(eq=False)
class LiveWatch:
    """A stream's watch on a task: ``changed`` is set by any wake-up, ``committed`` is set
    by one for committed events (or one that may have been missed); clear both yourself."""

    changed: asyncio.Event = field(default_factory=asyncio.Event)
    committed: bool = True


class EventHub:
    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._live: dict[str, set[LiveWatch]] = defaultdict(set)
        self._following: Following | None = None
        self.closing = False

    async def start(self) -> None:
        """Follow the wake-ups (on the running event loop); outages are logged here."""
        await self.stop()  # a hub started again follows once
        self.closing = False
        self._following = get_transport().follow_readers(
            self.wake, wake_all=self.wake_all, log=log, wake_deltas=self.wake_deltas
        )

    async def stop(self) -> None:
        following, self._following = self._following, None
        if following is not None:
            await following.stop()

    def close(self) -> None:
        """The process is stopping: every waiting stream wakes and ends, and so does any that
        starts from now on (on the event loop's thread)."""
        self.closing = True
        self.wake_all()

    def wake(self, task_id: str) -> None:
        for event in self._waiters.get(task_id, ()):
            event.set()
        for watch in self._live.get(task_id, ()):
            watch.committed = True
            watch.changed.set()

    def wake_deltas(self, task_id: str) -> None:
        for watch in self._live.get(task_id, ()):
            watch.changed.set()

    @contextlib.asynccontextmanager
    async def watch_live(self, task_id: str) -> AsyncIterator[LiveWatch]:
        """A watch woken by ``task_id``'s new events and by its new deltas."""
        watch = LiveWatch()
        self._live[task_id].add(watch)
        try:
            yield watch
        finally:
            self._live[task_id].discard(watch)
            if not self._live[task_id]:
                del self._live[task_id]

    @contextlib.asynccontextmanager
    async def watch(self, task_id: str) -> AsyncIterator[asyncio.Event]:
        """An event that is set whenever ``task_id`` gets new events (clear it yourself)."""
        event = asyncio.Event()
        self._waiters[task_id].add(event)
        try:
            yield event
        finally:
            self._waiters[task_id].discard(event)
            if not self._waiters[task_id]:
                del self._waiters[task_id]

    @contextlib.asynccontextmanager
    async def watch_many(self, task_ids: Iterable[str]) -> AsyncIterator[asyncio.Event]:
        """One event that is set whenever any of ``task_ids`` gets new events (a batch's long
        poll: clear it yourself)."""
        event = asyncio.Event()
        watched = list(dict.fromkeys(task_ids))
        for task_id in watched:
            self._waiters[task_id].add(event)
        try:
            yield event
        finally:
            for task_id in watched:
                self._waiters[task_id].discard(event)
                if not self._waiters[task_id]:
                    del self._waiters[task_id]

    def wake_all(self) -> None:
        for task_id in {*self._waiters, *self._live}:
            self.wake(task_id)


hub = EventHub()
