"""One subscription per API process to the event wake-ups, fanned out to waiting requests.

SSE streams and long polls wait on an asyncio.Event per task instead of each holding a
Redis connection; the hub sets the events of a task when a wake-up for it arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from shared import notify
from shared.constants import EVENTS_CHANNEL_PREFIX
from shared.settings import get_settings

log = logging.getLogger("ratchet.api.events")


class EventHub:
    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if get_settings().embedded:
            notify.add_listener(self._from_thread)
        else:
            self._task = asyncio.create_task(self._listen(), name="ratchet-event-hub")

    async def stop(self) -> None:
        notify.remove_listener(self._from_thread)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _from_thread(self, task_id: str) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.wake, task_id)

    def wake(self, task_id: str) -> None:
        for event in self._waiters.get(task_id, ()):
            event.set()

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

    async def _listen(self) -> None:
        url = get_settings().redis_url
        while True:
            client = aioredis.Redis.from_url(url)
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.psubscribe(EVENTS_CHANNEL_PREFIX + "*")
                    async for message in pubsub.listen():
                        if message.get("type") == "pmessage":
                            name = message["channel"]
                            name = name.decode() if isinstance(name, bytes) else str(name)
                            self.wake(name.removeprefix(EVENTS_CHANNEL_PREFIX))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("event wake-ups interrupted; reconnecting", exc_info=True)
                # Streams fall back to polling meanwhile; wake everyone so none waits long.
                for task_id in list(self._waiters):
                    self.wake(task_id)
                await asyncio.sleep(1)
            finally:
                await client.aclose()


hub = EventHub()
