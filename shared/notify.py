"""Wake-ups for readers of the event log, sent after a commit that appended events.

Postgres stays the source of truth: a wake-up only says "look again", so a lost one costs a
reader its fallback poll interval, nothing more. In production it is a Redis PUBLISH; in the
embedded default, a call to listeners in the same process.

The PUBLISHes go out from a thread of each process's own, as many as have gathered in one
pipeline: a step's commit hands its wake-up over and goes on, rather than wait a round trip
to Redis for each (three a tool step, about a tenth of a step's CPU when each took its own).
A pipeline follows the one before by ``PIPELINE_GAP_SECONDS`` at least: a wake-up that comes
while the publisher is idle goes out at once, and under load they gather (a busy worker's
pipelines then carry many wake-ups each, where each had carried one or two: a pipeline per
wake-up cost a busy worker an eighth of its CPU).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
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
BATCH_MAX = 500  # wake-ups in one pipeline, at most
PIPELINE_GAP_SECONDS = 0.02  # between the starts of two pipelines, at least


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


class Publisher:
    """A process's wake-ups to Redis (a PUBLISH of "1" on a channel), sent from a thread of
    their own in pipelines."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._pending: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._started = 0.0  # when the last pipeline started (monotonic)
        threading.Thread(target=self._run, name="ratchet-wake-ups", daemon=True).start()

    def put(self, channel_name: str) -> None:
        self._pending.put(channel_name)

    def _run(self) -> None:
        while True:
            first = self._pending.get()
            while (gap := self._started + PIPELINE_GAP_SECONDS - time.monotonic()) > 0:
                time.sleep(gap)  # the last pipeline went out just now: let more gather
            gathered = {first}  # a channel named twice is woken once
            while len(gathered) < BATCH_MAX:
                try:
                    gathered.add(self._pending.get_nowait())
                except queue.Empty:
                    break
            self.send(gathered)

    def send(self, channel_names: Iterable[str]) -> None:
        self._started = time.monotonic()  # the next pipeline goes a gap after this one
        try:
            with self._client.pipeline(transaction=False) as pipe:
                for name in channel_names:
                    pipe.publish(name, "1")
                pipe.execute()
        except redis.RedisError:
            log.debug("wake-ups not published", exc_info=True)


_publishers: dict[tuple[int, str], Publisher] = {}  # by process (threads die in a fork), URL


def _publisher(url: str) -> Publisher:
    key = (os.getpid(), url)
    publisher = _publishers.get(key)
    if publisher is None:
        with _lock:
            publisher = _publishers.get(key) or _publishers.setdefault(key, Publisher(_client(url)))
    return publisher


def publish(task_ids: Iterable[str]) -> None:
    """Tell readers these tasks have new events (sent in the background). Never raises."""
    settings = get_settings()
    with _lock:
        local = list(_listeners)
    for task_id in task_ids:
        for listener in local:
            listener(task_id)
        if not settings.embedded:
            _publisher(settings.redis_url).put(channel(task_id))


def publish_on(channel_name: str) -> None:
    """A wake-up on ``channel_name`` (sent in the background, with the process's others: many
    asked for at once go out as one). Never raises."""
    _publisher(get_settings().redis_url).put(channel_name)


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
