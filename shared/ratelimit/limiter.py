"""Fleet-wide rate limiting: token buckets in Redis, decided by one atomic Lua script.

Why a token bucket and not GCRA: a model call costs a *variable* number of tokens, known only
roughly beforehand, and is corrected after the call (refund or extra charge). A bucket holding
a level that may go below zero expresses "charge the difference" directly; GCRA would need the
same bookkeeping expressed as a shifted theoretical arrival time.

One decision is one script call: it reads every bucket the call must pass (provider:model
requests and tokens, tenant requests and tokens) and each bucket's fleet-wide block, and either
takes from all of them or from none. The script reads Redis ``TIME``, the only clock, so worker
clocks never matter. All keys share the ``{rl}`` hash tag: one slot, so the script is
cluster-safe. It never sleeps: it answers "go" or "retry after N ms".
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, cast

import redis
from redis.exceptions import NoScriptError

from shared.constants import RATE_LIMIT_PREFIX
from shared.ratelimit.buckets import (
    BLOCK_PREFIX,
    FACTOR_PREFIX,
    GRANTED,
    Bucket,
    Decision,
    Limiter,
    LimiterUnavailable,
    Take,
    describe,
)
from shared.ratelimit.scripts import (
    ADJUST,
    BLOCK,
    CUT,
    FACTOR,
    LEVEL,
    acquire_script,
)
from shared.transport import get_transport


@lru_cache(maxsize=64)
def _packer(count: int) -> Callable[..., bytes]:
    return struct.Struct(f"<{count}d").pack


def _minute() -> int:
    return int(time.time()) // 60


_pid = os.getpid()  # this process's pid, kept current across forks without a syscall per call


def _forked() -> None:
    global _pid  # noqa: PLW0603 - refreshed in a forked child
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


class RedisLimiter:
    """The production limiter: shared by every worker and API process of the fleet."""

    FLUSH_SECONDS = 1.0
    # A call that no bucket applies to still checks its model's pause (a provider's 429
    # anywhere in the fleet): each process asks Redis about a scope at most this often and
    # answers from what it last heard in between. The process that got the 429 knows at once;
    # the rest of the fleet within this time.
    PAUSE_CHECK_SECONDS = 0.1

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        # scope -> (when last heard from Redis, paused until), both on the monotonic clock
        self._pauses: dict[str, tuple[float, float]] = {}
        # Each decision appends what it counts here (deque appends are thread-safe): a grant
        # its scopes, a refusal its scope and wait. The flusher thread adds them to the shared
        # statistics about once a second: a decision pays no lock and no write for them.
        self._granted: collections.deque[tuple[str, ...]] = collections.deque()
        self._denied: collections.deque[tuple[str, int]] = collections.deque()
        self._flusher_lock = threading.Lock()
        self._flusher_pid = 0
        self._shapes: dict[tuple[int, int], str] = {}  # (buckets, blocks) -> the script's sha
        self._adjust = client.register_script(ADJUST)
        self._level = client.register_script(LEVEL)
        self._block = client.register_script(BLOCK)
        self._factor = client.register_script(FACTOR)
        self._cut = client.register_script(CUT)

    @staticmethod
    def block_key(scope: str) -> str:
        return BLOCK_PREFIX + scope

    @staticmethod
    def stats_key(minute: int) -> str:
        return f"{RATE_LIMIT_PREFIX}stats:{minute}"

    def acquire(self, takes: Sequence[Take], *, blocks: Sequence[str] = ()) -> Decision:
        """Take from every bucket or from none; ``blocks`` are scopes a 429 may have paused."""
        if not takes and not blocks:
            return GRANTED
        if not takes:
            known = self._known_pauses(blocks)
            if known is not None:
                return known
        keys = [t.bucket.key for t in takes]
        if blocks:
            keys += [BLOCK_PREFIX + scope for scope in blocks]
        spec: list[float] = []
        for take in takes:
            bucket = take.bucket
            burst = bucket.burst
            spec += (bucket.per_ms, burst, take.cost if take.cost < burst else burst)
        try:
            answer = self._decide((len(takes), len(blocks)), keys, spec=_packer(len(spec))(*spec))
        except redis.RedisError as exc:
            raise LimiterUnavailable(f"rate limiter unavailable: {exc}") from exc
        if self._flusher_pid != _pid:
            self._start_flusher()
        if answer == 0:
            if not takes:
                heard = time.monotonic()
                self._pauses.update((scope, (heard, 0.0)) for scope in blocks)
            self._granted.append(tuple(t.bucket.scope for t in takes))
            return GRANTED
        wait, who = int(answer[0]), int(answer[1])
        if who > len(takes):
            scope = blocks[who - len(takes) - 1]
            self._heard_pause(scope, wait / 1000)
            self._denied.append((scope, wait))
            return Decision(False, retry_after_ms=wait, scope=f"blocked:{scope}")
        scope = takes[who - 1].bucket.scope
        self._denied.append((scope, wait))
        return Decision(False, retry_after_ms=wait, scope=scope)

    def _known_pauses(self, blocks: Sequence[str]) -> Decision | None:
        """The decision on ``blocks`` from what this process last heard, or None if it must
        ask Redis (a scope it has not heard about within ``PAUSE_CHECK_SECONDS``)."""
        now = time.monotonic()
        for scope in blocks:
            heard, until = self._pauses.get(scope, (-math.inf, 0.0))
            if until > now:
                wait = math.ceil((until - now) * 1000)
                self._denied.append((scope, wait))
                return Decision(False, retry_after_ms=wait, scope=f"blocked:{scope}")
            if now - heard > self.PAUSE_CHECK_SECONDS:
                return None
        return GRANTED

    def _heard_pause(self, scope: str, seconds: float) -> None:
        now = time.monotonic()
        self._pauses[scope] = (now, now + seconds)

    def _decide(self, shape: tuple[int, int], keys: list[str], *, spec: bytes) -> Any:
        """The shape's script by its hash (loading it first if Redis does not know it)."""
        sha = self._shapes.get(shape)
        if sha is not None:
            try:
                return self.client.evalsha(sha, len(keys), *keys, spec)
            except redis.exceptions.NoScriptError:
                pass  # Redis restarted or its scripts were flushed: load it again
        sha = self._shapes[shape] = cast(str, self.client.script_load(acquire_script(*shape)))
        return self.client.evalsha(sha, len(keys), *keys, spec)

    def _start_flusher(self) -> None:
        """One flusher thread per process (a forked child starts its own)."""
        with self._flusher_lock:
            if self._flusher_pid != _pid:
                self._flusher_pid = _pid
                threading.Thread(
                    target=self._flush_forever, name="ratchet-limiter-stats", daemon=True
                ).start()

    def _flush_forever(self) -> None:
        while True:
            time.sleep(self.FLUSH_SECONDS)
            self.flush()

    def flush(self) -> None:
        """Add this process's counted grants to the shared stats (best effort)."""
        counts: collections.Counter[str] = collections.Counter()
        while self._granted:
            for scope in self._granted.popleft():
                counts[f"allowed:{scope}"] += 1
        while self._denied:
            scope, wait = self._denied.popleft()
            counts[f"denied:{scope}"] += 1
            counts[f"wait_ms:{scope}"] += wait
        if not counts:
            return
        key = self.stats_key(_minute())
        pipe = self.client.pipeline(transaction=False)
        for field, count in counts.items():
            pipe.hincrby(key, field, count)
        pipe.expire(key, 600)
        with contextlib.suppress(redis.RedisError):  # statistics only: decisions are made in Redis
            pipe.execute()

    def adjust(self, changes: Sequence[tuple[Take, float]]) -> None:
        """Take ``delta`` more from each take's bucket (give back, if negative): the real use
        of a call against its estimate. All in one round trip."""
        changes = [(take, delta) for take, delta in changes if delta != 0]
        if not changes:
            return
        try:
            try:
                self._adjust_all(changes)
            except NoScriptError:  # the server lost its scripts (a restart, a flush)
                self.client.script_load(ADJUST)
                self._adjust_all(changes)
        except redis.RedisError as exc:
            raise LimiterUnavailable(f"rate limiter unavailable: {exc}") from exc

    def _adjust_all(self, changes: Sequence[tuple[Take, float]]) -> None:
        # By hash in a plain pipeline: a Script object in one would first ask the server
        # whether it has the script, a round trip more than the adjustments save.
        with self.client.pipeline(transaction=False) as pipe:
            for take, delta in changes:
                bucket = take.bucket
                pipe.evalsha(self._adjust.sha, 1, bucket.key, bucket.per_ms, bucket.burst, delta)
            pipe.execute()

    def block(self, scope: str, seconds: float) -> None:
        """Stop every worker from calling ``scope`` for ``seconds`` (a provider's Retry-After)."""
        ms = max(1, math.ceil(seconds * 1000))
        keys = [self.block_key(scope), self.stats_key(_minute())]
        self._block(keys=keys, args=[ms, f"provider_429:{scope}"])
        self._heard_pause(scope, ms / 1000)

    def factor(self, scope: str) -> float:
        """The share of its configured rate ``scope`` may use now (1 unless cut by 429s)."""
        try:
            return float(self._factor(keys=[FACTOR_PREFIX + scope]))
        except redis.RedisError as exc:
            raise LimiterUnavailable(f"rate limiter unavailable: {exc}") from exc

    def cut(self, scope: str, *, window_ms: int = 0) -> float:
        """A provider's 429: multiply ``scope``'s share down, unless it was cut less than
        ``window_ms`` ago (the same overload); returns the share."""
        try:
            return float(self._cut(keys=[FACTOR_PREFIX + scope], args=[window_ms]))
        except redis.RedisError as exc:
            raise LimiterUnavailable(f"rate limiter unavailable: {exc}") from exc

    def snapshot(self, buckets: Sequence[Bucket]) -> list[dict[str, Any]]:
        try:
            return self._snapshot(buckets)
        except redis.RedisError as exc:
            raise LimiterUnavailable(f"rate limiter unavailable: {exc}") from exc

    def _snapshot(self, buckets: Sequence[Bucket]) -> list[dict[str, Any]]:
        self.flush()
        minutes = [_minute() - i for i in range(5)]
        stats = [cast(dict[Any, Any], self.client.hgetall(self.stats_key(m))) for m in minutes]
        out = []
        for bucket in buckets:
            args = [bucket.per_ms, bucket.burst]
            level = float(self._level(keys=[bucket.key], args=args))
            out.append(describe(bucket, level, stats))
        return out

    def blocked(self) -> dict[str, int]:
        """Scopes paused by a provider's 429, with the milliseconds left."""
        try:
            return self._blocked()
        except redis.RedisError as exc:
            raise LimiterUnavailable(f"rate limiter unavailable: {exc}") from exc

    def _blocked(self) -> dict[str, int]:
        prefix = self.block_key("")
        out = {}
        for key in self.client.scan_iter(match=prefix + "*", count=500):
            name = key.decode() if isinstance(key, bytes) else str(key)
            ttl = int(cast(int, self.client.pttl(name)))
            if ttl > 0:
                out[name[len(prefix) :]] = ttl
        return out


def get_limiter() -> Limiter:
    """The limiter of the transport: Redis in production, process memory under ``ratchet
    dev``."""
    return get_transport().limiter()
