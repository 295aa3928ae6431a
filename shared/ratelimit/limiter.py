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


# A bucket is one 16-byte string: two little-endian doubles, its level and the Redis-clock ms
# of that level, packed by the ``struct`` library Redis gives its scripts. A block is one
# string, the Redis-clock ms it lasts until (and it expires then). So a decision reads every
# key it needs with one MGET and writes every bucket with one MSET, however many buckets apply.
#
# What a decision costs in Redis, measured: three ``redis.call`` (TIME, MGET, MSET) about 7 us,
# an empty script 2-3 us. So the script does as little else as it can:
# - binary state and arguments: in a script, turning a number into text (``..``) or text into
#   a number (``tonumber``) costs 0.5-1.5 us each, and those conversions were most of a
#   decision's time when buckets were text (23 us of server time for three buckets, now 10);
# - one script per shape (number of buckets, number of blocks), written out without loops or
#   tables: a decision of three buckets runs straight-line code;
# - statistics are counted by the caller (see ``RedisLimiter.flush``), not in the script.
#
# KEYS: the n buckets, then the m blocks.
# ARGV[1]: per bucket its rate_per_ms, burst and cost, packed as doubles.
# Answer: 0 ("go", every bucket taken from), or {wait_ms, index of the key that said no}.


@lru_cache(maxsize=64)
def acquire_script(n: int, m: int) -> str:
    """The decision for ``n`` buckets and ``m`` blocks (a script per shape, see above)."""
    lines = [
        "local t = redis.call('TIME')",
        "local now = t[1] * 1000 + math.floor(t[2] / 1000)",
        f"local v = redis.call('MGET', {', '.join(f'KEYS[{k}]' for k in range(1, n + m + 1))})",
        "local wait, who = 0, 0",
    ]
    for j in range(n + 1, n + m + 1):
        lines.append(f"if v[{j}] and v[{j}] - now > wait then wait, who = v[{j}] - now, {j} end")
    if m:
        lines.append("if wait > 0 then return {wait, who} end")
    if n:
        lines.append(
            "local pack, unpack, min, max = struct.pack, struct.unpack, math.min, math.max"
        )
        lines.append("local pos, per_ms, burst, cost, level, ts = 1")
    for i in range(1, n + 1):
        lines += [
            "per_ms, burst, cost, pos = unpack('<ddd', ARGV[1], pos)",
            f"if v[{i}] then level, ts = unpack('<dd', v[{i}]) else level, ts = burst, now end",
            f"local l{i} = min(burst, level + max(0, now - ts) * per_ms) - cost",
            f"if l{i} < 0 then",
            f"  local need = math.ceil(-l{i} / per_ms)",
            f"  if need > wait then wait, who = need, {i} end",
            "end",
        ]
    if n:
        lines.append("if wait > 0 then return {wait, who} end")
        writes = ", ".join(f"KEYS[{i}], pack('<dd', l{i}, now)" for i in range(1, n + 1))
        lines.append(f"redis.call('MSET', {writes})")
    lines.append("return 0")
    return "\n".join(lines) + "\n"


# Buckets carry no expiry (MSET sets none, and one more call per bucket would cost more than
# the keys): there is one per configured model scope and per tenant, about 120 bytes each, and
# a stale level is harmless (it is capped at the bucket's capacity when read).

_READ_LEVEL = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local per_ms, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local level, ts = burst, now
local value = redis.call('GET', KEYS[1])
if value then level, ts = struct.unpack('<dd', value) end
level = math.min(burst, level + math.max(0, now - ts) * per_ms)
"""

# Refund (delta < 0 takes back less) or charge the difference after the real usage is known.
ADJUST = (
    _READ_LEVEL
    + """
redis.call('SET', KEYS[1], struct.pack('<dd', math.min(burst, level - tonumber(ARGV[3])), now))
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


# Bucket keys changed form twice (a hash, then text, now packed doubles) and block keys once (a
# flag, now the ms they last until): each form has its own prefix, so a fleet half upgraded
# never reads a key of another form. Blocks expire; old buckets are ignored.
BUCKET_PREFIX = f"{RATE_LIMIT_PREFIX}bucket-v3:"
BLOCK_PREFIX = f"{RATE_LIMIT_PREFIX}until:"
FACTOR_PREFIX = f"{RATE_LIMIT_PREFIX}factor:"


class RedisLimiter:
    """The production limiter: shared by every worker and API process of the fleet."""

    FLUSH_SECONDS = 1.0

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
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
            self._granted.append(tuple(t.bucket.scope for t in takes))
            return GRANTED
        wait, who = int(answer[0]), int(answer[1])
        if who > len(takes):
            scope = blocks[who - len(takes) - 1]
            self._denied.append((scope, wait))
            return Decision(False, retry_after_ms=wait, scope=f"blocked:{scope}")
        scope = takes[who - 1].bucket.scope
        self._denied.append((scope, wait))
        return Decision(False, retry_after_ms=wait, scope=scope)

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

    def adjust(self, take: Take, delta: float) -> None:
        if delta == 0:
            return
        bucket = take.bucket
        try:
            self._adjust(keys=[bucket.key], args=[bucket.per_ms, bucket.burst, delta])
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
            level = float(self._level(keys=[bucket.key], args=args))
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
