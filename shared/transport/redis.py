"""The production transport: Redis for wake-ups, cancels, the live view, the gate and the limiter.

Every Redis client of a process is made here, with one set of timeouts: commands and the
connections that only listen. Clients are kept per URL for the life of the process, so each
URL has one connection pool however many parts of the process use it (a forked child's pool
starts afresh on its first command, as redis-py's pools do).

Wake-ups go out from a thread of each process's own, as many as have gathered in one
pipeline: a step's commit hands its wake-up over and goes on, rather than wait a round trip
to Redis for each (three a tool step, about a tenth of a step's CPU when each took its own).
At most ``PIPELINES_PER_WINDOW`` pipelines start within any ``PIPELINE_WINDOW_SECONDS``: a
quiet process's wake-ups go out at once (a one-step task's start and end are two wake-ups a
few ms apart, and its client waits on the second), and under load they gather (a busy
worker's pipelines then carry many wake-ups each, where each had carried one or two: a
pipeline per wake-up cost a busy worker an eighth of its CPU).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import lru_cache
from typing import Literal

import redis
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub as AsyncPubSub

from shared.constants import (
    CANCELS_CHANNEL,
    DELTAS_CHANNEL,
    DELTAS_PREFIX,
    DISPATCH_CHANNEL_PREFIX,
    EVENTS_CHANNEL_PREFIX,
    LAST_SWEEP_PREFIX,
    WORKER_PREFIX,
    WORKERS_PREFIX,
)
from shared.deltas import LOG_MAX_ENTRIES, LOG_TTL_SECONDS, Delta, Piece
from shared.ratelimit.limiter import RedisLimiter
from shared.settings import Settings
from shared.transport.base import (
    GATE_LANDING_SECONDS,
    Following,
    Listener,
    Transport,
    TransportUnavailable,
)

log = logging.getLogger("ratchet.transport")

# The one set of timeouts. A command waits at most this long to connect and for its answer:
# every caller has a fallback (a poll, the heartbeat, the sweeper, "no" from the gate), so an
# unreachable Redis must cost a call seconds, never hang it.
CONNECT_TIMEOUT_SECONDS = 2.0
COMMAND_TIMEOUT_SECONDS = 2.0
# Off: a PING after each idle spell would add a round trip to the first command after it, and
# a broken connection already shows as an error at that command, where the fallback takes over.
HEALTH_CHECK_INTERVAL_SECONDS = 0
# A listener that lost Redis tries again after this long, doubling up to the cap.
RECONNECT_FIRST_SECONDS = 0.5
RECONNECT_MAX_SECONDS = 30.0

BATCH_MAX = 500  # wake-ups in one pipeline, at most
# Pipelines that may start within any window: a burst goes out at once, a stream gathers.
PIPELINES_PER_WINDOW = 4
PIPELINE_WINDOW_SECONDS = 0.02
LOOP_CONNECTIONS = 16  # an event loop's commands (its streams' reads of deltas), at most
IN_FLIGHT_SUFFIX = ":in-flight"  # the gate's key and this: its slots taken, not landed
FORGET_AFTER_SECONDS = 600  # a process silent this long leaves the live view's index too

# KEYS: the gate, its slots in flight; ARGV: the slots, the gate's life and the in-flight
# count's, in ms. Opens (or closes) the gate; answers the slots in flight.
_RESET = """
local slots = tonumber(ARGV[1])
if slots > 0 then
  redis.call('SET', KEYS[1], slots, 'PX', ARGV[2])
else
  redis.call('DEL', KEYS[1])
end
return tonumber(redis.call('GET', KEYS[2]) or '0')
"""
# KEYS: the gate, its slots in flight; ARGV: the in-flight count's life in ms. Takes one of the
# gate's slots, if it has one left (DECR keeps the key's expiry), and counts it in flight.
_TAKE = """
local left = tonumber(redis.call('GET', KEYS[1]) or '0')
if left <= 0 then return 0 end
redis.call('DECR', KEYS[1])
redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""
# KEYS: the gate's slots in flight. One has landed (never below 0: a count that expired first
# is not brought back).
_LAND = """
local flying = tonumber(redis.call('GET', KEYS[1]) or '0')
if flying > 0 then redis.call('DECR', KEYS[1]) end
return 0
"""

# KEYS: the tasks' delta logs (streams), a key a piece. ARGV: the cap, the TTL in ms, the wake-up
# channel, the prefix of the keys, then five values a piece: step, epoch, attempt, after, data.
# Appends each piece with the rules of ``shared.deltas``: a piece of an older call than its
# log's last entry's is refused; a newer call's first piece, where the log ends in a delta of
# the same step, goes in after a discard entry (its data as ``discarded_data`` writes it).
# Then one wake-up names every task that got a piece. One call a batch: a command a piece
# cost the worker more CPU than the rest of its streaming.
_APPEND_DELTAS = """
local cap, ttl, channel, prefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local woken = {}
for i, key in ipairs(KEYS) do
  local at = 4 + (i - 1) * 5
  local step, epoch, attempt, after = ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4]
  local e, t = tonumber(epoch), tonumber(attempt)
  local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)[1]
  local refused = false
  if last then
    local f = {}
    for j = 1, #last[2], 2 do f[last[2][j]] = last[2][j + 1] end
    local le, lt = tonumber(f['e']), tonumber(f['t'])
    refused = e < le or (e == le and t < lt)
    if not refused and (e ~= le or t ~= lt) and f['k'] == 'delta' and f['s'] == step then
      local reason = 'rerun'
      if e == le then reason = 'retried' end
      redis.call('XADD', key, 'MAXLEN', '~', cap, '*', 'k', 'discarded', 's', step,
        'e', epoch, 't', attempt, 'a', after,
        'd', '{"step":' .. step .. ',"reason":"' .. reason .. '"}')
    end
  end
  if not refused then
    redis.call('XADD', key, 'MAXLEN', '~', cap, '*', 'k', 'delta', 's', step,
      'e', epoch, 't', attempt, 'a', after, 'd', ARGV[at + 5])
    redis.call('PEXPIRE', key, ttl)
    woken[#woken + 1] = string.sub(key, #prefix + 1)
  end
end
if #woken > 0 then redis.call('PUBLISH', channel, table.concat(woken, ' ')) end
return #woken
"""
# A stream entry's id (``<ms>-<n>``) as one increasing number: ``ms * 1000 + n`` (a task's log
# never gets a thousand entries in one millisecond: its worker appends every few tens of ms).
POS_PER_MS = 1000


def position(entry_id: bytes | str) -> int:
    ms, _, n = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms) * POS_PER_MS + int(n or 0)


def entry_id(pos: int) -> str:
    return f"{pos // POS_PER_MS}-{pos % POS_PER_MS}"


@lru_cache
def command_client(url: str) -> redis.Redis:
    """The process's client for commands to ``url`` (one connection pool per URL)."""
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
        socket_timeout=COMMAND_TIMEOUT_SECONDS,
        health_check_interval=HEALTH_CHECK_INTERVAL_SECONDS,
    )


@lru_cache
def listening_client(url: str) -> redis.Redis:
    """The process's client for subscriptions to ``url``: no read timeout, since a listener
    waits for messages as long as none comes."""
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
        health_check_interval=HEALTH_CHECK_INTERVAL_SECONDS,
    )


def async_listening_client(url: str) -> aioredis.Redis:
    """A client for one subscription on the running event loop (close it when it ends: an
    asyncio client belongs to its loop, so it is made anew each time)."""
    return aioredis.Redis.from_url(
        url,
        socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
        health_check_interval=HEALTH_CHECK_INTERVAL_SECONDS,
    )


class Publisher:
    """A process's wake-ups to Redis (a PUBLISH of "1" on a channel), sent from a thread of
    their own in pipelines."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._pending: queue.SimpleQueue[str] = queue.SimpleQueue()
        # When the latest pipelines started (monotonic), oldest first.
        self._starts: collections.deque[float] = collections.deque(maxlen=PIPELINES_PER_WINDOW)
        threading.Thread(target=self._run, name="ratchet-wake-ups", daemon=True).start()

    def put(self, channel_name: str) -> None:
        self._pending.put(channel_name)

    def _run(self) -> None:
        while True:
            first = self._pending.get()
            while (gap := self._next_start() - time.monotonic()) > 0:
                time.sleep(gap)  # the window's pipelines went out just now: let more gather
            gathered = {first}  # a channel named twice is woken once
            while len(gathered) < BATCH_MAX:
                try:
                    gathered.add(self._pending.get_nowait())
                except queue.Empty:
                    break
            self.send(gathered)

    def _next_start(self) -> float:
        """When the next pipeline may start: at once, unless the window's pipelines all
        started within the last window."""
        if len(self._starts) < PIPELINES_PER_WINDOW:
            return 0.0
        return self._starts[0] + PIPELINE_WINDOW_SECONDS

    def send(self, channel_names: Iterable[str]) -> None:
        self._starts.append(time.monotonic())
        try:
            with self._client.pipeline(transaction=False) as pipe:
                for name in channel_names:
                    pipe.publish(name, "1")
                pipe.execute()
        except redis.RedisError:
            log.debug("wake-ups not published", exc_info=True)


class RedisWaiter:
    """The dispatcher's subscription to its channel; on an outage it waits on the wake-ups
    of its own process until Redis answers again."""

    def __init__(self, client: redis.Redis, channel: str, *, local: threading.Event) -> None:
        self._channel = channel
        self._local = local
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]

    def wait(self, timeout: float) -> bool:
        try:
            if not self._pubsub.subscribed:
                self._pubsub.subscribe(self._channel)
            woken = self._pubsub.get_message(timeout=timeout) is not None
            while woken and self._pubsub.get_message(timeout=0) is not None:
                pass  # one round answers every wake-up sent so far
            return woken
        except redis.RedisError:
            log.debug("dispatcher wake-ups unavailable; polling", exc_info=True)
            with contextlib.suppress(redis.RedisError):
                self._pubsub.reset()
            return self._local.wait(timeout)

    def close(self) -> None:
        self._pubsub.close()


class RedisFollowing:
    """An API process's subscription to every task's event wake-ups (and delta wake-ups, when
    it has a listener for them), on its event loop."""

    def __init__(
        self,
        url: str,
        wake: Listener,
        *,
        wake_all: Callable[[], None],
        log: logging.Logger,
        wake_deltas: Listener | None = None,
    ) -> None:
        self._url, self._wake, self._wake_all, self._log = url, wake, wake_all, log
        self._wake_deltas = wake_deltas
        self._task = asyncio.create_task(self._listen(), name="ratchet-event-hub")

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _listen(self) -> None:
        """Subscribe, and resubscribe after an outage with a capped exponential back-off.

        An outage is logged once when it starts and once when it ends: a Redis that is down
        for an hour must not write a traceback a second. Meanwhile readers poll Postgres."""
        delay, down_since = RECONNECT_FIRST_SECONDS, None
        while True:
            client = async_listening_client(self._url)
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.psubscribe(EVENTS_CHANNEL_PREFIX + "*")
                    if self._wake_deltas is not None:
                        await pubsub.subscribe(DELTAS_CHANNEL)
                    if down_since is not None:
                        self._log.info(
                            "event wake-ups restored after %.0f s", time.monotonic() - down_since
                        )
                    delay, down_since = RECONNECT_FIRST_SECONDS, None
                    self._wake_all()  # events committed while unsubscribed were not announced
                    await self._relay(pubsub)
            except asyncio.CancelledError:
                raise
            except (aioredis.RedisError, OSError) as exc:
                if down_since is None:
                    down_since = time.monotonic()
                    self._log.warning(
                        "event wake-ups lost (%s: %s); streams poll the database until Redis is "
                        "back",
                        type(exc).__name__,
                        exc,
                    )
                self._wake_all()  # so none waits longer than its fallback poll
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_SECONDS)
            finally:
                await client.aclose()

    async def _relay(self, pubsub: AsyncPubSub) -> None:
        async for message in pubsub.listen():
            kind = message.get("type")
            if kind == "pmessage":
                name = message["channel"]
                name = name.decode() if isinstance(name, bytes) else str(name)
                self._wake(name.removeprefix(EVENTS_CHANNEL_PREFIX))
            elif kind == "message" and self._wake_deltas is not None:
                data = message["data"]
                for task_id in (data.decode() if isinstance(data, bytes) else str(data)).split():
                    self._wake_deltas(task_id)


def follow_cancels_forever(url: str, cancel: Listener, *, log: logging.Logger) -> None:
    """Follow the cancels channel for as long as the process lives, reconnecting with a
    capped backoff; an outage is logged once when it starts and once when it ends."""
    delay, down_since = RECONNECT_FIRST_SECONDS, None
    while True:
        pubsub = listening_client(url).pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
        try:
            pubsub.subscribe(CANCELS_CHANNEL)
            if down_since is not None:
                log.warning("cancel wake-ups are back after %.0f s", time.monotonic() - down_since)
                down_since = None
            delay = RECONNECT_FIRST_SECONDS
            for message in pubsub.listen():
                if message.get("type") == "message":
                    cancel(message["data"].decode())
        except redis.RedisError as exc:
            if down_since is None:
                down_since = time.monotonic()
                log.warning("cancel wake-ups are down (%s); the heartbeat still finds cancels", exc)
            with contextlib.suppress(redis.RedisError):
                pubsub.close()  # its connection goes back to the pool, to be checked on reuse
            time.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_SECONDS)


@contextlib.contextmanager
def _unavailable() -> Iterator[None]:
    """Turns a Redis error into :class:`TransportUnavailable`."""
    try:
        yield
    except redis.RedisError as exc:
        raise TransportUnavailable(str(exc)) from exc


class RedisPresence:
    """A sorted set of members (scored by when each last published), a record per member that
    expires on its own, and the last sweep; all keyed by the fleet's queue name. Reads are
    bounded: the newest members, one MGET."""

    def __init__(self, client: redis.Redis, name: str) -> None:
        self.client = client
        self.index = WORKERS_PREFIX + name
        self.prefix = f"{WORKER_PREFIX}{name}:"
        self.sweep_key = LAST_SWEEP_PREFIX + name

    def put(self, member: str, record: str, *, seen_at: float, ttl_seconds: float) -> None:
        with _unavailable(), self.client.pipeline(transaction=False) as pipe:
            pipe.set(self.prefix + member, record, px=max(1, int(ttl_seconds * 1000)))
            pipe.zadd(self.index, {member: seen_at})
            pipe.zremrangebyscore(self.index, "-inf", seen_at - FORGET_AFTER_SECONDS)
            pipe.expire(self.index, FORGET_AFTER_SECONDS)
            pipe.execute()

    def remove(self, member: str) -> None:
        with _unavailable(), self.client.pipeline(transaction=False) as pipe:
            pipe.delete(self.prefix + member)
            pipe.zrem(self.index, member)
            pipe.execute()

    def records(self, limit: int) -> list[str | bytes]:
        with _unavailable():
            members: list[bytes] = self.client.zrevrange(self.index, 0, limit - 1)  # type: ignore[assignment]
            if not members:
                return []
            raws: list[bytes | None] = self.client.mget([self.prefix + m.decode() for m in members])  # type: ignore[assignment]
        return [raw for raw in raws if raw]

    def put_sweep(self, record: str) -> None:
        with _unavailable():
            self.client.set(self.sweep_key, record)

    def sweep(self) -> bytes | None:
        with _unavailable():
            return self.client.get(self.sweep_key)  # type: ignore[return-value]


def _deltas(entries: Sequence[tuple[bytes, dict[bytes, bytes]]]) -> list[Delta]:
    """A delta log's entries (XRANGE's answer) as readers get them."""
    found = []
    for raw_id, fields in entries:
        step, after_seq, data = int(fields[b"s"]), int(fields[b"a"]), fields[b"d"].decode()
        kind: Literal["delta", "discarded"] = (
            "discarded" if fields[b"k"] == b"discarded" else "delta"
        )
        found.append(Delta(position(raw_id), kind, step, after_seq, data))
    return found


class RedisTransport(Transport):
    """Redis at ``redis_url`` for wake-ups, cancels, the live view and the limiter; the
    broker at ``broker_url`` (None: a broker other than Redis, which is not looked into) for
    its queues and the gate that goes with them."""

    name = "redis"

    def __init__(self, redis_url: str, *, broker_url: str | None) -> None:
        self.redis_url = redis_url
        self._client = command_client(redis_url)
        self._broker = command_client(broker_url) if broker_url is not None else None
        self._take = self._broker.register_script(_TAKE) if self._broker is not None else None
        self._reset = self._broker.register_script(_RESET) if self._broker is not None else None
        self._land = self._broker.register_script(_LAND) if self._broker is not None else None
        self._append_deltas = self._client.register_script(_APPEND_DELTAS)
        self._limiter = RedisLimiter(self._client)
        self._publisher: tuple[int, Publisher] | None = None  # by process: threads die in a fork
        self._lock = threading.Lock()
        self._local = threading.Event()  # this process's dispatcher wake-ups, for outages
        self._presences: dict[str, RedisPresence] = {}
        self._loop_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis] = (
            weakref.WeakKeyDictionary()
        )

    def broker_options(self, settings: Settings) -> dict[str, float]:
        return {"visibility_timeout": settings.visibility_timeout_seconds}

    def queue_depth(self, queue: str) -> int | None:
        if self._broker is None:
            return None
        with _unavailable():
            return int(self._broker.llen(queue))  # type: ignore[arg-type]

    def oldest_message(self, queue: str) -> bytes | None:
        if self._broker is None:
            return None
        with _unavailable():
            return self._broker.lindex(queue, -1)  # type: ignore[return-value]

    def _publisher_here(self) -> Publisher:
        pid = os.getpid()
        current = self._publisher
        if current is None or current[0] != pid:
            with self._lock:
                current = self._publisher
                if current is None or current[0] != pid:
                    current = self._publisher = (pid, Publisher(self._client))
        return current[1]

    def wake_readers(self, task_ids: Iterable[str]) -> None:
        publisher = self._publisher_here()
        for task_id in task_ids:
            publisher.put(EVENTS_CHANNEL_PREFIX + task_id)

    def wake_dispatcher(self, queue_name: str) -> None:
        self._local.set()
        self._publisher_here().put(DISPATCH_CHANNEL_PREFIX + queue_name)

    def dispatcher_waiter(self, queue_name: str) -> RedisWaiter:
        channel = DISPATCH_CHANNEL_PREFIX + queue_name
        return RedisWaiter(listening_client(self.redis_url), channel, local=self._local)

    def wake_cancel(self, task_id: str) -> None:
        try:
            self._client.publish(CANCELS_CHANNEL, task_id)
        except redis.RedisError:
            log.warning("cancel wake-up for %s not published; the heartbeat will see it", task_id)

    def follow_readers(
        self,
        wake: Listener,
        *,
        wake_all: Callable[[], None],
        log: logging.Logger,
        wake_deltas: Listener | None = None,
    ) -> Following:
        return RedisFollowing(
            self.redis_url, wake, wake_all=wake_all, log=log, wake_deltas=wake_deltas
        )

    def append_deltas(self, pieces: Sequence[Piece]) -> bool:
        """One script call for the whole batch (see ``_APPEND_DELTAS``)."""
        keys = [DELTAS_PREFIX + p.task_id for p in pieces]
        args: list[str | int] = [LOG_MAX_ENTRIES, LOG_TTL_SECONDS * 1000, DELTAS_CHANNEL]
        args.append(DELTAS_PREFIX)
        for p in pieces:
            args += [p.step, p.epoch, p.attempt, p.after, p.data]
        try:
            self._append_deltas(keys=keys, args=args)
        except redis.RedisError:
            log.debug("deltas not appended", exc_info=True)
            return False
        return True

    def read_deltas(self, task_id: str, *, after: int, limit: int) -> list[Delta]:
        start = f"({entry_id(after)}" if after else "-"
        with _unavailable():
            entries = self._client.xrange(DELTAS_PREFIX + task_id, start, "+", count=limit)
        return _deltas(entries)  # type: ignore[arg-type]

    async def aread_deltas(self, task_id: str, *, after: int, limit: int) -> list[Delta]:
        start = f"({entry_id(after)}" if after else "-"
        try:
            entries = await self._loop_client().xrange(
                DELTAS_PREFIX + task_id, start, "+", count=limit
            )
        except (aioredis.RedisError, OSError) as exc:
            raise TransportUnavailable(str(exc)) from exc
        return _deltas(entries)

    def _loop_client(self) -> aioredis.Redis:
        """The running event loop's client for commands (an asyncio client belongs to its
        loop): one pool of at most ``LOOP_CONNECTIONS``, however many streams read at once."""
        loop = asyncio.get_running_loop()
        client = self._loop_clients.get(loop)
        if client is None:
            pool = aioredis.BlockingConnectionPool.from_url(
                self.redis_url,
                max_connections=LOOP_CONNECTIONS,
                timeout=COMMAND_TIMEOUT_SECONDS,
                socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
                socket_timeout=COMMAND_TIMEOUT_SECONDS,
                health_check_interval=HEALTH_CHECK_INTERVAL_SECONDS,
            )
            client = self._loop_clients[loop] = aioredis.Redis(connection_pool=pool)
        return client

    def follow_cancels(self, cancel: Listener, *, log: logging.Logger) -> None:
        threading.Thread(
            target=follow_cancels_forever,
            args=(self.redis_url, cancel),
            kwargs={"log": log},
            name="ratchet-cancels",
            daemon=True,
        ).start()

    def presence(self, name: str) -> RedisPresence:
        found = self._presences.get(name)
        if found is None:
            found = self._presences.setdefault(name, RedisPresence(self._client, name))
        return found

    def reset_gate(self, key: str, slots: int, *, ttl_seconds: float) -> int:
        if self._broker is None or self._reset is None:
            return 0  # another broker has no gate: everything goes through the backlog
        life_ms = max(1, int(ttl_seconds * 1000))
        try:
            flying = self._reset(
                keys=[key, key + IN_FLIGHT_SUFFIX], args=[slots, life_ms], client=self._broker
            )
        except redis.RedisError:
            log.debug("the gate was not reset; it closes by itself", exc_info=True)
            return 0
        return int(flying)

    def take_gate_slot(self, key: str) -> bool:
        if self._broker is None or self._take is None:
            return False
        life_ms = int(GATE_LANDING_SECONDS * 1000)
        try:
            return bool(
                self._take(keys=[key, key + IN_FLIGHT_SUFFIX], args=[life_ms], client=self._broker)
            )
        except redis.RedisError:
            log.debug("the gate could not be read; through the backlog", exc_info=True)
            return False

    def land_gate_slot(self, key: str) -> None:
        if self._broker is None or self._land is None:
            return
        try:
            self._land(keys=[key + IN_FLIGHT_SUFFIX], client=self._broker)
        except redis.RedisError:
            log.debug("a gate slot's landing was not counted; it expires", exc_info=True)

    def limiter(self) -> RedisLimiter:
        return self._limiter

    def readiness(self) -> dict[str, str]:
        try:
            self._client.ping()
        except Exception as exc:
            return {"redis": f"error: {type(exc).__name__}"}
        return {"redis": "ok"}
