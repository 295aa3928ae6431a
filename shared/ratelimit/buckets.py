"""What the limiter works with: a bucket, a take from it, a decision, and the ``Limiter``
interface its Redis and in-process implementations share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

from shared.constants import RATE_LIMIT_PREFIX
from shared.errors import RatchetError


class LimiterUnavailable(RatchetError):
    """The rate limiter's store cannot be reached; the call is denied, never waved through."""


# Bucket keys changed form twice (a hash, then text, now packed doubles) and block keys once (a
# flag, now the ms they last until): each form has its own prefix, so a fleet half upgraded
# never reads a key of another form. Blocks expire; old buckets are ignored.
BUCKET_PREFIX = f"{RATE_LIMIT_PREFIX}bucket-v3:"


BLOCK_PREFIX = f"{RATE_LIMIT_PREFIX}until:"


FACTOR_PREFIX = f"{RATE_LIMIT_PREFIX}factor:"


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
    def adjust(self, changes: Sequence[tuple[Take, float]]) -> None: ...
    def block(self, scope: str, seconds: float) -> None: ...
    def factor(self, scope: str) -> float: ...
    def cut(self, scope: str, *, window_ms: int = 0) -> float: ...
    def snapshot(self, buckets: Sequence[Bucket]) -> list[dict[str, Any]]: ...
    def blocked(self) -> dict[str, int]: ...


def describe(bucket: Bucket, level: float, stats: list[dict[Any, Any]]) -> dict[str, Any]:
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
