"""The in-process limiter of the embedded default (one process, no Redis): the same buckets
and decisions as the Redis limiter, in memory."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from typing import Any

from shared.ratelimit.buckets import Bucket, Decision, Take, describe
from shared.ratelimit.scripts import DECREASE, FLOOR, RECOVERY_PER_MS


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

    def adjust(self, changes: Sequence[tuple[Take, float]]) -> None:
        now = time.monotonic() * 1000
        with self._lock:
            for take, delta in changes:
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
            return [describe(b, self._level(b, now), stats) for b in buckets]

    def blocked(self) -> dict[str, int]:
        now = time.monotonic() * 1000
        with self._lock:
            return {s: math.ceil(u - now) for s, u in self._blocked.items() if u > now}
