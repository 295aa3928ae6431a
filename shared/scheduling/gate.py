"""The direct path: a task submitted while nothing waits ahead of it skips the backlog.

Admission through the dispatcher costs a task an UPDATE and a wait for the next round. When
the fleet has room and no task waits, a round would admit a new task at once anyway, so the
submission admits it itself: its INSERT sets ``admitted_ms`` and the API sends its message
once committed (lost, the sweeper sends it, as for any admitted task). Admitted, it holds
its slots like any other: the dispatcher's next round counts it.

The gate is a number of slots. The dispatcher opens it after a round that left no due task
waiting for room, with the budget that round left unspent (the fleet's free slots, within
the broker's window), for ``GATE_SECONDS``; each submission that goes direct takes one.
A round that leaves a due task waiting for room closes it, and so does a leader giving up.
So a task goes direct only when the dispatcher would have admitted it at once, and never
ahead of one waiting in the backlog: fairness, priority and capacity hold as through the
backlog. Tasks under a concurrency limit, and tasks not due yet, always go through the
backlog (the API counts no slots). A tenant's default share of the fleet is kept by the
gate's size instead: a round opens it with no more slots than the busiest tenant under that
share may still take, so whoever takes them, no tenant goes past its share (and while one is
at its share, everything goes through the backlog).

Taking a slot is one Redis script on the broker, or process memory when embedded; no answer
is a no. Off by default (``RATCHET_DIRECT_ADMISSION``): the task starts a few milliseconds
sooner, but the API then sends every message itself, one at a time, where a round sends
many in one pipeline.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import lru_cache
from typing import Any

import redis

from shared.constants import DISPATCH_GATE_PREFIX
from shared.queue import redis_broker_url
from shared.settings import get_settings

log = logging.getLogger("ratchet.dispatch")
GATE_SECONDS = 1.0  # an open gate closes by itself this long after the round that opened it

# KEYS: the gate. Takes one of its slots, if it has one left (DECR keeps the key's expiry).
_TAKE = """
local left = tonumber(redis.call('GET', KEYS[1]) or '0')
if left <= 0 then return 0 end
redis.call('DECR', KEYS[1])
return 1
"""


class _Local:
    """The embedded gate, in process memory."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.slots = 0
        self.until = 0.0  # time.monotonic() it closes by itself


_local = _Local()


@lru_cache
def _broker(url: str) -> tuple[redis.Redis, Any]:
    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    return client, client.register_script(_TAKE)


def _key() -> str:
    return DISPATCH_GATE_PREFIX + get_settings().queue_name


def open_gate(slots: int) -> None:
    """A round left nothing due waiting, and ``slots`` to spare: let so many in directly."""
    settings = get_settings()
    if not settings.direct_admission or slots <= 0:
        close_gate()
        return
    if settings.embedded:
        with _local.lock:
            _local.slots, _local.until = slots, time.monotonic() + GATE_SECONDS
        return
    url = redis_broker_url()
    if url is not None:
        try:
            _broker(url)[0].set(_key(), slots, px=int(GATE_SECONDS * 1000))
        except redis.RedisError:
            log.debug("the gate was not opened", exc_info=True)


def close_gate() -> None:
    """Work waits for room (or no dispatcher leads here any more): all through the backlog.
    Nothing to do with direct admission off (a gate left open then closes by itself)."""
    settings = get_settings()
    if not settings.direct_admission:
        return
    if settings.embedded:
        with _local.lock:
            _local.slots = 0
        return
    url = redis_broker_url()
    if url is not None:
        try:
            _broker(url)[0].delete(_key())
        except redis.RedisError:
            log.debug("the gate was not closed; it closes by itself", exc_info=True)


def take_slot() -> bool:
    """Whether a submission due now may be admitted directly: takes one of the gate's slots.
    Never raises."""
    settings = get_settings()
    if not settings.direct_admission:
        return False
    if settings.embedded:
        with _local.lock:
            if _local.slots <= 0 or _local.until <= time.monotonic():
                return False
            _local.slots -= 1
            return True
    url = redis_broker_url()
    if url is None:
        return False
    client, script = _broker(url)
    try:
        return bool(script(keys=[_key()], client=client))
    except redis.RedisError:
        log.debug("the gate could not be read; through the backlog", exc_info=True)
        return False
