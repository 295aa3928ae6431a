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
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Protocol, cast

import redis

from shared.constants import RATE_LIMIT_PREFIX
from shared.errors import RatchetError


class LimiterUnavailable(RatchetError):
    """The rate limiter's store cannot be reached; the call is denied, never waved through."""


@dataclass(frozen=True)
class Bucket:
    """``rate`` units per ``period_s``, with bursts of up to ``capacity`` units."""

    scope: str
    rate: float
    period_s: float = 60.0
    capacity: float | None = None

    @cached_property
    def burst(self) -> float:
        return self.capacity if self.capacity is not None else self.rate

    @cached_property
    def per_ms(self) -> float:
        return self.rate / (self.period_s * 1000)

    @cached_property
    def key(self) -> str:
        """Its state's key in Redis."""
        return BUCKET_PREFIX + self.scope


@dataclass(frozen=True)
class Take:
    bucket: Bucket
    cost: float = 1.0


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after_ms: int = 0
    scope: str | None = None  # the bucket (or block) that said no

    @property
    def blocked(self) -> bool:
        return self.scope is not None and self.scope.startswith("blocked:")


GRANTED = Decision(True)


class Limiter(Protocol):
    def acquire(self, takes: Sequence[Take], *, blocks: Sequence[str] = ()) -> Decision: ...
    def adjust(self, take: Take, delta: float) -> None: ...
    def block(self, scope: str, seconds: float) -> None: ...
    def factor(self, scope: str) -> float: ...
    def cut(self, scope: str, *, window_ms: int = 0) -> float: ...
    def snapshot(self, buckets: Sequence[Bucket]) -> list[dict[str, Any]]: ...
    def blocked(self) -> dict[str, int]: ...


# A bucket is one string, "<level>:<ms of that level>"; a block is one string, the Redis-clock
# ms it lasts until (and it expires then). So a decision reads every key it needs with one
# MGET and writes every bucket with one MSET, however many buckets apply: the script's cost
# hardly grows with them.
#
# KEYS: the n buckets, then the m blocks, then the stats hash.
# ARGV: n, m, then per bucket: rate_per_ms, burst, cost. A scope's name is its key past the
# prefix (ARGV carries nothing it can derive: fewer arguments, a shorter round trip).
_ACQUIRE = """
local tonumber, min, max, ceil, match = tonumber, math.min, math.max, math.ceil, string.match
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n, m = tonumber(ARGV[1]), tonumber(ARGV[2])
local values = redis.call('MGET', unpack(KEYS, 1, n + m))
local wait, who = 0, nil
for j = n + 1, n + m do
  local left = (tonumber(values[j]) or 0) - now
  if left > wait then wait, who = left, j end
end
local writes = {}
if wait == 0 then
  for i = 1, n do
    local per_ms = tonumber(ARGV[3 * i])
    local burst, cost = tonumber(ARGV[3 * i + 1]), tonumber(ARGV[3 * i + 2])
    local level, ts = burst, now
    local value = values[i]
    if value then
      local l, s = match(value, '^([^:]+):(.+)$')
      level, ts = tonumber(l), tonumber(s)
    end
    level = min(burst, level + max(0, now - ts) * per_ms)
    if level < cost then
      local need = ceil((cost - level) / per_ms)
      if need > wait then wait, who = need, i end
    end
    writes[2 * i - 1], writes[2 * i] = KEYS[i], (level - cost) .. ':' .. now
  end
end
if wait > 0 then
  local stats = KEYS[n + m + 1]
  local name = who > n and string.sub(KEYS[who], BLOCK_PREFIX_LEN + 1)
    or string.sub(KEYS[who], BUCKET_PREFIX_LEN + 1)
  redis.call('HINCRBY', stats, 'denied:' .. name, 1)
  redis.call('HINCRBY', stats, 'wait_ms:' .. name, wait)
  redis.call('PEXPIRE', stats, 600000)
  if who > n then return {wait, 'blocked:' .. name} end
  return {wait, name}
end
if n > 0 then redis.call('MSET', unpack(writes)) end
return 0
"""
# The "go" path writes only the buckets: grants are counted in each process and added to the
# stats hash about once a second (FLUSH_SECONDS), which keeps the common decision short.
# Buckets carry no expiry: there is one per configured scope, and a stale level is harmless
# (it is capped at the bucket's capacity when read).

_READ_LEVEL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local per_ms, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local level, ts = burst, now
local value = redis.call('GET', KEYS[1])
if value then
  local l, s = string.match(value, '^([^:]+):(.+)$')
  level, ts = tonumber(l), tonumber(s)
end
level = math.min(burst, level + math.max(0, now - ts) * per_ms)
"""

# Refund (delta < 0 takes back less) or charge the difference after the real usage is known.
ADJUST = (
    _READ_LEVEL
    + """
redis.call('SET', KEYS[1], math.min(burst, level - tonumber(ARGV[3])) .. ':' .. now)
return 1
"""
)

LEVEL = _READ_LEVEL + "return tostring(level)\n"

# Block a scope until now + ARGV[1] ms on the Redis clock, and count the provider's 429.
BLOCK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ms = tonumber(ARGV[1])
redis.call('SET', KEYS[1], now + ms, 'PX', ms)
redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
redis.call('EXPIRE', KEYS[2], 600)
return 1
"""


# Adaptive limits (AIMD): a scope's factor, the share of its configured rate it may use, is
# "<factor>:<ms>" with additive recovery since then; a provider's 429 multiplies it down.
DECREASE = 0.5
FLOOR = 0.1
RECOVERY_PER_MS = 0.1 / 60_000  # a tenth of the configured rate per minute

_READ_FACTOR = f"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local factor = 1
local value = redis.call('GET', KEYS[1])
if value then
  local f, s = string.match(value, '^([^:]+):(.+)$')
  factor = math.min(1, tonumber(f) + (now - tonumber(s)) * {RECOVERY_PER_MS!r})
end
"""
FACTOR = _READ_FACTOR + "return tostring(factor)\n"
# ARGV[1]: a window in ms. A provider rejects every call in flight when its quota trips:
# the 429s that arrive within the window of the last cut are the same overload, cut once.
CUT = (
    _READ_FACTOR
    + f"""
if value then
  local since = now - tonumber(string.match(value, ':(.+)$'))
  if since < tonumber(ARGV[1]) then return tostring(factor) end
end
factor = math.max({FLOOR!r}, factor * {DECREASE!r})
local back_ms = math.ceil((1 - factor) / {RECOVERY_PER_MS!r})
redis.call('SET', KEYS[1], factor .. ':' .. now, 'PX', back_ms + 60000)
return tostring(factor)
"""
)


def _minute() -> int:
    return int(time.time()) // 60


_pid = os.getpid()  # this process's pid, kept current across forks without a syscall per call


def _forked() -> None:
    global _pid  # noqa: PLW0603 - refreshed in a forked child
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


# Bucket and block keys changed form once (hashes and flags before): new prefixes, so a fleet
# half upgraded never reads a key of the other form. The old keys expire or are ignored.
BUCKET_PREFIX = f"{RATE_LIMIT_PREFIX}level:"
BLOCK_PREFIX = f"{RATE_LIMIT_PREFIX}until:"
FACTOR_PREFIX = f"{RATE_LIMIT_PREFIX}factor:"
ACQUIRE = _ACQUIRE.replace("BLOCK_PREFIX_LEN", str(len(BLOCK_PREFIX))).replace(
    "BUCKET_PREFIX_LEN", str(len(BUCKET_PREFIX))
)


class RedisLimiter:
    """The production limiter: shared by every worker and API process of the fleet."""

    FLUSH_SECONDS = 1.0

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        # Each grant appends its scopes here (deque appends are thread-safe); the flusher
        # thread counts them. A decision pays no lock for its statistics.
        self._granted: collections.deque[tuple[str, ...]] = collections.deque()
        self._flusher_lock = threading.Lock()
        self._flusher_pid = 0
        self._stats_key = (0, "")
        self._acquire = client.register_script(ACQUIRE)
        self._adjust = client.register_script(ADJUST)
        self._level = client.register_script(LEVEL)
        self._block = client.register_script(BLOCK)
        self._factor = client.register_script(FACTOR)
        self._cut = client.register_script(CUT)

    @staticmethod
    def bucket_key(scope: str) -> str:
        return BUCKET_PREFIX + scope

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
        keys = [t.bucket.key for t in takes]
        keys += [BLOCK_PREFIX + scope for scope in blocks]
        keys.append(self._current_stats_key())
        args: list[Any] = [len(takes), len(blocks)]
        for take in takes:
            bucket = take.bucket
            burst = bucket.burst
            args += (bucket.per_ms, burst, take.cost if take.cost < burst else burst)
        try:
            answer = self._evalsha(keys, args)
        except redis.RedisError as exc:
            raise LimiterUnavailable(f"rate limiter unavailable: {exc}") from exc
        if answer == 0:
            self._granted.append(tuple(t.bucket.scope for t in takes))
            if self._flusher_pid != _pid:
                self._start_flusher()
            return GRANTED
        wait, scope = answer
        who = scope.decode() if isinstance(scope, bytes) else str(scope)
        return Decision(False, retry_after_ms=int(wait), scope=who)

    def _evalsha(self, keys: list[str], args: list[Any]) -> Any:
        """The script by its hash (loading it once if Redis does not know it yet)."""
        try:
            return self.client.evalsha(self._acquire.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return self._acquire(keys=keys, args=args)

    def _current_stats_key(self) -> str:
        minute = _minute()
        if self._stats_key[0] != minute:
            self._stats_key = (minute, self.stats_key(minute))
        return self._stats_key[1]

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
        granted: dict[str, int] = {}
        while self._granted:
            for scope in self._granted.popleft():
                granted[scope] = granted.get(scope, 0) + 1
        if not granted:
            return
        key = self.stats_key(_minute())
        pipe = self.client.pipeline(transaction=False)
        for scope, count in granted.items():
            pipe.hincrby(key, f"allowed:{scope}", count)
        pipe.expire(key, 600)
        with contextlib.suppress(redis.RedisError):  # statistics only: decisions are made in Redis
            pipe.execute()

    def adjust(self, take: Take, delta: float) -> None:
        if delta == 0:
            return
        bucket = take.bucket
        try:
            self._adjust(
                keys=[self.bucket_key(bucket.scope)], args=[bucket.per_ms, bucket.burst, delta]
            )
        except redis.RedisError as exc:
            raise LimiterUnavailable(f"rate limiter unavailable: {exc}") from exc

    def block(self, scope: str, seconds: float) -> None:
        """Stop every worker from calling ``scope`` for ``seconds`` (a provider's Retry-After)."""
        ms = max(1, math.ceil(seconds * 1000))
        keys = [self.block_key(scope), self.stats_key(_minute())]
        self._block(keys=keys, args=[ms, f"provider_429:{scope}"])

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
            level = float(self._level(keys=[self.bucket_key(bucket.scope)], args=args))
            out.append(_describe(bucket, level, stats))
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


def _describe(bucket: Bucket, level: float, stats: list[dict[Any, Any]]) -> dict[str, Any]:
    # A provider 429 blocks the model itself (scope "provider:model"), not one of its buckets:
    # a model bucket ("model:provider:model:requests") also reports its model's blocks.
    scopes = [bucket.scope]
    if bucket.scope.startswith("model:"):
        scopes.append(bucket.scope.removeprefix("model:").rsplit(":", 1)[0])

    def total(name: str) -> int:
        keys = [f"{name}:{scope}" for scope in scopes]
        return sum(int(s.get(k, s.get(k.encode(), 0))) for s in stats for k in keys)

    return {
        "scope": bucket.scope,
        "rate": bucket.rate,
        "period_s": bucket.period_s,
        "capacity": bucket.burst,
        "level": round(level, 3),
        "last_5_minutes": {
            "allowed": total("allowed"),
            "denied": total("denied"),
            "wait_ms": total("wait_ms"),
            "provider_429s": total("provider_429"),
        },
    }


class LocalLimiter:
    """The same buckets in process memory, for the embedded default (one process, one clock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._levels: dict[str, tuple[float, float]] = {}
        self._blocked: dict[str, float] = {}
        self._stats: dict[str, int] = {}
        self._factors: dict[str, tuple[float, float]] = {}

    def _level(self, bucket: Bucket, now: float) -> float:
        level, ts = self._levels.get(bucket.scope, (bucket.burst, now))
        return min(bucket.burst, level + max(0.0, now - ts) * bucket.per_ms)

    def _count(self, name: str, scope: str, value: int = 1) -> None:
        key = f"{name}:{scope}"
        self._stats[key] = self._stats.get(key, 0) + value

    def acquire(self, takes: Sequence[Take], *, blocks: Sequence[str] = ()) -> Decision:
        now = time.monotonic() * 1000
        with self._lock:
            for scope in blocks:
                until = self._blocked.get(scope, 0.0)
                if until > now:
                    self._count("denied", scope)
                    return Decision(False, math.ceil(until - now), f"blocked:{scope}")
            levels = [self._level(t.bucket, now) for t in takes]
            waits = [
                (math.ceil((min(t.cost, t.bucket.burst) - level) / t.bucket.per_ms), t.bucket.scope)
                for t, level in zip(takes, levels, strict=True)
                if level < min(t.cost, t.bucket.burst)
            ]
            if waits:
                wait, scope = max(waits)
                self._count("denied", scope)
                self._count("wait_ms", scope, wait)
                return Decision(False, wait, scope)
            for take, level in zip(takes, levels, strict=True):
                self._levels[take.bucket.scope] = (level - min(take.cost, take.bucket.burst), now)
                self._count("allowed", take.bucket.scope)
        return Decision(True)

    def adjust(self, take: Take, delta: float) -> None:
        now = time.monotonic() * 1000
        with self._lock:
            level = self._level(take.bucket, now) - delta
            self._levels[take.bucket.scope] = (min(take.bucket.burst, level), now)

    def block(self, scope: str, seconds: float) -> None:
        with self._lock:
            self._blocked[scope] = time.monotonic() * 1000 + seconds * 1000
            self._count("provider_429", scope)

    def factor(self, scope: str) -> float:
        now = time.monotonic() * 1000
        with self._lock:
            return self._factor_at(scope, now)

    def _factor_at(self, scope: str, now: float) -> float:
        factor, since = self._factors.get(scope, (1.0, now))
        return min(1.0, factor + (now - since) * RECOVERY_PER_MS)

    def cut(self, scope: str, *, window_ms: int = 0) -> float:
        now = time.monotonic() * 1000
        with self._lock:
            last = self._factors.get(scope)
            if last is not None and now - last[1] < window_ms:
                return self._factor_at(scope, now)
            factor = max(FLOOR, self._factor_at(scope, now) * DECREASE)
            self._factors[scope] = (factor, now)
            return factor

    def snapshot(self, buckets: Sequence[Bucket]) -> list[dict[str, Any]]:
        now = time.monotonic() * 1000
        with self._lock:
            stats = [dict(self._stats)]
            return [_describe(b, self._level(b, now), stats) for b in buckets]

    def blocked(self) -> dict[str, int]:
        now = time.monotonic() * 1000
        with self._lock:
            return {s: math.ceil(u - now) for s, u in self._blocked.items() if u > now}


@lru_cache
def _redis_limiter(url: str) -> RedisLimiter:
    return RedisLimiter(redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2))


_local = LocalLimiter()


def get_limiter() -> Limiter:
    """Redis in production; process memory in the embedded default."""
    from shared.settings import get_settings

    settings = get_settings()
    if settings.embedded:
        return _local
    return _redis_limiter(settings.redis_url)
