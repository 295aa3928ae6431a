"""The one place "Redis or in process" is decided: what the fleet's processes say to each other
outside the database (wake-ups, cancels, the live view, the direct-admission gate), the rate
limiter's store, and a look into the broker's queues. Production runs on Redis
(``RedisTransport``, which also makes every Redis client of a process, with one set of
timeouts); ``ratchet dev`` runs in one process (``LocalTransport``). :func:`get_transport`
chooses from the settings once, as ``shared.store.backends`` chooses the database.
"""

from __future__ import annotations

import os
from functools import lru_cache

from shared.settings import Settings, get_settings
from shared.transport.base import Transport, TransportUnavailable

__all__ = [
    "Transport",
    "TransportUnavailable",
    "get_transport",
    "reset_transport",
    "transport_for",
]

_chosen: tuple[Settings, Transport] | None = None  # the settings read last, and their choice


def get_transport() -> Transport:
    """The transport of the current settings. Cheap enough for every wake-up: the choice is
    remembered for the settings object it was made from."""
    global _chosen  # noqa: PLW0603 - one choice per settings object
    settings = get_settings()
    chosen = _chosen
    if chosen is not None and chosen[0] is settings:
        return chosen[1]
    transport = transport_for(settings)
    _chosen = (settings, transport)
    return transport


def transport_for(settings: Settings) -> Transport:
    """The transport ``settings`` describe: in process when the queue is (``ratchet dev``),
    else Redis."""
    if settings.embedded:
        return _local()
    from shared.queue import redis_broker_url

    return _redis(settings.redis_url, redis_broker_url(settings))


@lru_cache(maxsize=1)
def _local() -> Transport:
    """One per process, never reset: its listeners and memory are the process's own, as a
    broker's would be."""
    from shared.transport.local import LocalTransport  # imported late: it imports the queue

    return LocalTransport()


@lru_cache
def _redis(redis_url: str, broker_url: str | None) -> Transport:
    """One per pair of URLs for the life of the process: its clients' connection pools and
    its publisher thread are reused whatever else changes in the settings."""
    from shared.transport.redis import RedisTransport  # imported late: it imports the limiter

    return RedisTransport(redis_url, broker_url=broker_url)


def _forget_after_fork() -> None:
    """A forked child (a worker's pool process, started again after one was killed) makes its
    own Redis transport. The parent's may have been in use on another thread at the fork: its
    connection pool's lock held, it would make every call of the child fail
    (``ChildDeadlockedError``), and its publisher thread is not in the child at all."""
    global _chosen  # noqa: PLW0603 - nothing of the parent's is used again
    _chosen = None
    _redis.cache_clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def reset_transport() -> None:
    """Choose again at the next call (tests that change the settings). The transports
    themselves are kept: see ``_local`` and ``_redis``."""
    global _chosen  # noqa: PLW0603
    _chosen = None
