"""Wake-ups for readers of the event log, sent after a commit that appended events.

Postgres stays the source of truth: a wake-up only says "look again", so a lost one costs a
reader its fallback poll interval, nothing more. In production it is a Redis PUBLISH; in the
embedded default, a call to listeners in the same process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from functools import lru_cache

import redis

from shared.constants import CANCELS_CHANNEL, EVENTS_CHANNEL_PREFIX
from shared.settings import get_settings

log = logging.getLogger("ratchet.notify")
Listener = Callable[[str], None]
_listeners: set[Listener] = set()
_cancel_listeners: set[Listener] = set()
_lock = threading.Lock()


def channel(task_id: str) -> str:
    return EVENTS_CHANNEL_PREFIX + task_id


@lru_cache
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)


def add_listener(listener: Listener) -> None:
    with _lock:
        _listeners.add(listener)


def remove_listener(listener: Listener) -> None:
    with _lock:
        _listeners.discard(listener)


def publish(task_ids: Iterable[str]) -> None:
    """Tell readers these tasks have new events. Never raises."""
    settings = get_settings()
    with _lock:
        local = list(_listeners)
    for task_id in task_ids:
        for listener in local:
            listener(task_id)
        if not settings.embedded:
            try:
                _client(settings.redis_url).publish(channel(task_id), "1")
            except redis.RedisError:
                log.debug("event wake-up not published", exc_info=True)


def add_cancel_listener(listener: Listener) -> None:
    with _lock:
        _cancel_listeners.add(listener)


def publish_cancel(task_id: str) -> None:
    """Tell the worker running ``task_id`` that a cancel was requested, so that its step stops
    waiting. Never raises: a lost wake-up leaves it to the heartbeat, which sees the flag."""
    settings = get_settings()
    with _lock:
        local = list(_cancel_listeners)
    for listener in local:
        listener(task_id)
    if not settings.embedded:
        try:
            _client(settings.redis_url).publish(CANCELS_CHANNEL, task_id)
        except redis.RedisError:
            log.warning("cancel wake-up for %s not published; the heartbeat will see it", task_id)
