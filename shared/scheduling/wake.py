"""Waking the dispatcher after a commit that left it work: a Redis PUBLISH in production, an
event in the same process when embedded. A lost wake-up costs the work one poll interval of
the dispatcher (it looks again on its own), nothing more."""

from __future__ import annotations

import contextlib
import logging
import threading

import redis

from shared import notify
from shared.constants import DISPATCH_CHANNEL_PREFIX
from shared.settings import get_settings

log = logging.getLogger("ratchet.dispatch")
_local = threading.Event()


def channel(queue_name: str | None = None) -> str:
    """The channel the dispatcher of ``queue_name`` (this process's queue) listens on."""
    return DISPATCH_CHANNEL_PREFIX + (queue_name or get_settings().queue_name)


def wake() -> None:
    """Tell the dispatcher to look now: the PUBLISH goes out from the process's wake-up thread,
    so a submission does not wait a round trip to Redis for it, and the wake-ups of many
    submissions at once go out as one. Never raises."""
    _local.set()
    if not get_settings().embedded:
        notify.publish_on(channel())


class Waiter:
    """What the dispatcher waits on between rounds: a wake-up, or the timeout."""

    def __init__(self) -> None:
        settings = get_settings()
        self._pubsub: redis.client.PubSub | None = None
        if not settings.embedded:
            client = redis.Redis.from_url(
                settings.redis_url, socket_timeout=5, socket_connect_timeout=2
            )
            self._pubsub = client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a wake-up; whether one came."""
        if self._pubsub is None:
            woken = _local.wait(timeout)
            _local.clear()
            return woken
        try:
            if not self._pubsub.subscribed:
                self._pubsub.subscribe(channel())  # type: ignore[no-untyped-call]
            woken = self._pubsub.get_message(timeout=timeout) is not None
            while woken and self._pubsub.get_message(timeout=0) is not None:
                pass  # one round answers every wake-up sent so far
            return woken
        except redis.RedisError:
            log.debug("dispatcher wake-ups unavailable; polling", exc_info=True)
            self._reset()
            return _local.wait(timeout)

    def _reset(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(redis.RedisError):
                self._pubsub.reset()

    def close(self) -> None:
        if self._pubsub is not None:
            self._pubsub.close()
