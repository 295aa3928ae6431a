"""One subscription per API process to the event wake-ups, fanned out to waiting requests.

SSE streams and long polls wait on an asyncio.Event per task instead of each holding a
Redis connection; the hub sets the events of a task when a wake-up for it arrives. When the
process is stopping, :meth:`EventHub.close` wakes every one of them for good: ``closing`` tells
a stream to end (with a last event saying so) instead of waiting on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from shared import notify
from shared.constants import EVENTS_CHANNEL_PREFIX
from shared.settings import get_settings

log = logging.getLogger("ratchet.api.events")
RECONNECT_FIRST_SECONDS = 0.5
RECONNECT_MAX_SECONDS = 30.0


class EventHub:
    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self.closing = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.closing = False
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

    def close(self) -> None:
        """The process is stopping: every waiting stream wakes and ends, and so does any that
        starts from now on (on the event loop's thread)."""
        self.closing = True
        self.wake_all()

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

    def wake_all(self) -> None:
        for task_id in list(self._waiters):
            self.wake(task_id)

    async def _listen(self) -> None:
        """Subscribe, and resubscribe after an outage with a capped exponential back-off.

        An outage is logged once when it starts and once when it ends: a Redis that is down
        for an hour must not write a traceback a second. Meanwhile streams poll Postgres."""
        url = get_settings().redis_url
        delay, down_since = RECONNECT_FIRST_SECONDS, None
        while True:
            client = aioredis.Redis.from_url(url, socket_connect_timeout=RECONNECT_MAX_SECONDS)
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.psubscribe(EVENTS_CHANNEL_PREFIX + "*")
                    if down_since is not None:
                        log.info(
                            "event wake-ups restored after %.0f s", time.monotonic() - down_since
                        )
                    delay, down_since = RECONNECT_FIRST_SECONDS, None
                    self.wake_all()  # events committed while unsubscribed were not announced
                    await self._relay(pubsub)
            except asyncio.CancelledError:
                raise
            except (aioredis.RedisError, OSError) as exc:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning(
                        "event wake-ups lost (%s: %s); streams poll the database until Redis is "
                        "back",
                        type(exc).__name__,
                        exc,
                    )
                self.wake_all()  # so none waits longer than its fallback poll
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_SECONDS)
            finally:
                await client.aclose()

    async def _relay(self, pubsub: PubSub) -> None:
        async for message in pubsub.listen():
            if message.get("type") == "pmessage":
                name = message["channel"]
                name = name.decode() if isinstance(name, bytes) else str(name)
                self.wake(name.removeprefix(EVENTS_CHANNEL_PREFIX))


hub = EventHub()
