"""Which rate-limit buckets apply to a model call or a submission, from settings and a file.

``RATCHET_RATE_LIMITS`` (JSON) or ``RATCHET_RATE_LIMITS_FILE`` (TOML) — the env wins on a clash::

    [models."openai:gpt-4o-mini"]     # or "openai:*" for every model of a provider
    requests = 500                    # per `per_seconds` (default 60)
    tokens = 200000
    [tenants."*"]                     # every tenant; a tenant's own name overrides
    requests = 60
    tokens = 100000
    submissions = 120                 # POST /v1/tasks per `per_seconds`

Token costs are counted before the call (``workers.tokens``: tiktoken for OpenAI models, about
four characters a token for others, plus the call's ``max_tokens``) and corrected with the
provider's reported usage afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from shared import configfile
from shared.ratelimit.buckets import Bucket, LimiterUnavailable, Take
from shared.ratelimit.limiter import get_limiter
from shared.settings import get_settings


class LimitSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests: float | None = Field(None, gt=0)
    tokens: float | None = Field(None, gt=0)
    submissions: float | None = Field(None, gt=0)
    per_seconds: float = Field(60.0, gt=0)
    burst_requests: float | None = Field(None, gt=0)
    burst_tokens: float | None = Field(None, gt=0)


class LimitsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: dict[str, LimitSpec] = Field(default_factory=dict)
    tenants: dict[str, LimitSpec] = Field(default_factory=dict)


def parse_inline(text: str) -> LimitsConfig:
    """``RATCHET_RATE_LIMITS``; ValueError naming what is wrong (settings validation calls it)."""
    return configfile.parse_inline(LimitsConfig, text)


def parse_file(file: Path) -> LimitsConfig:
    """``RATCHET_RATE_LIMITS_FILE``; ValueError naming what is wrong."""
    return configfile.parse_file(LimitsConfig, file)


@lru_cache
def _load(file: Path | None, inline: str) -> LimitsConfig:
    # Both were checked when the settings were read; the env wins over the file on a clash.
    config = parse_file(file) if file is not None else LimitsConfig()
    if inline:
        extra = parse_inline(inline)
        config = LimitsConfig(
            models={**config.models, **extra.models}, tenants={**config.tenants, **extra.tenants}
        )
    return config


def limits() -> LimitsConfig:
    settings = get_settings()
    return _load(settings.rate_limits_file, settings.rate_limits)


def _model_spec(model: str) -> LimitSpec | None:
    config = limits().models
    return config.get(model) or config.get(model.split(":", 1)[0] + ":*")


def _tenant_spec(tenant: str) -> LimitSpec | None:
    config = limits().tenants
    return config.get(tenant) or config.get("*")


def _buckets(scope: str, spec: LimitSpec | None) -> tuple[Bucket | None, Bucket | None]:
    if spec is None:
        return None, None
    requests = tokens = None
    if spec.requests:
        requests = Bucket(f"{scope}:requests", spec.requests, spec.per_seconds, spec.burst_requests)
    if spec.tokens:
        tokens = Bucket(f"{scope}:tokens", spec.tokens, spec.per_seconds, spec.burst_tokens)
    return requests, tokens


def call_takes(model: str, tenant: str, estimated_tokens: int | Callable[[], int]) -> list[Take]:
    """Every bucket a model call must pass, with what it costs each. With adaptive limits, a
    model's buckets run at the share of their configured rate its 429s have left it.

    ``estimated_tokens`` may be a function: the prompt is then counted only if a tokens
    bucket applies (counting a long conversation with a tokenizer is work of its own)."""
    takes: list[Take] = []
    counted: int | None = None
    for scope, spec in (
        (f"model:{model}", _model_spec(model)),
        (f"tenant:{tenant}", _tenant_spec(tenant)),
    ):
        share = adaptive_share(scope) if spec is not None and scope.startswith("model:") else 1.0
        requests, tokens = (_scaled(b, share) for b in _buckets(scope, spec))
        if requests:
            takes.append(Take(requests, 1))
        if tokens:
            if counted is None:
                counted = estimated_tokens() if callable(estimated_tokens) else estimated_tokens
            takes.append(Take(tokens, counted))
    return takes


def _scaled(bucket: Bucket | None, share: float) -> Bucket | None:
    if bucket is None or share >= 1.0:
        return bucket
    burst = bucket.burst * share
    return Bucket(bucket.scope, bucket.rate * share, bucket.period_s, burst)


# --- adaptive limits (AIMD, RATCHET_RATE_LIMIT_ADAPTIVE) --------------------------------------

SHARE_CACHE_SECONDS = 1.0  # each process asks Redis for a model's share at most once a second
_shares: dict[str, tuple[float, float]] = {}


def adaptive_share(scope: str) -> float:
    """The share of its configured rates ``scope`` (``model:<provider:model>``) may use: 1
    unless adaptive limits are on and its provider answered 429 lately."""
    if not get_settings().rate_limit_adaptive:
        return 1.0
    cached = _shares.get(scope)
    if cached is not None and time.monotonic() - cached[0] < SHARE_CACHE_SECONDS:
        return cached[1]
    try:
        share = get_limiter().factor(scope)
    except LimiterUnavailable:
        return cached[1] if cached else 1.0  # the decision itself will wait for Redis
    _shares[scope] = (time.monotonic(), share)
    return share


def after_429(model: str, *, pause_s: float = 0.0) -> float | None:
    """A provider answered 429: with adaptive limits on, cut the model's share (for the
    whole fleet) and return it; None when they are off. The 429s of one overload (those
    within its pause, or a second) cut it once."""
    if not get_settings().rate_limit_adaptive:
        return None
    scope = f"model:{model}"
    share = get_limiter().cut(scope, window_ms=int(max(pause_s, 1.0) * 1000))
    _shares[scope] = (time.monotonic(), share)
    return share


def submission_take(tenant: str) -> Take | None:
    spec = _tenant_spec(tenant)
    if spec is None or not spec.submissions:
        return None
    return Take(Bucket(f"tenant:{tenant}:submissions", spec.submissions, spec.per_seconds), 1)


def configured_buckets() -> list[Bucket]:
    """Every bucket the configuration names (tenant "*" is shown as that pattern)."""
    out: list[Bucket] = []
    config = limits()
    for model, spec in config.models.items():
        out += [b for b in _buckets(f"model:{model}", spec) if b]
    for tenant, spec in config.tenants.items():
        out += [b for b in _buckets(f"tenant:{tenant}", spec) if b]
        take = submission_take(tenant) if spec.submissions else None
        if take:
            out.append(take.bucket)
    return out


def tenant_buckets(tenant: str) -> list[Bucket]:
    """The buckets that hold back ``tenant``'s own calls and submissions."""
    out = [b for b in _buckets(f"tenant:{tenant}", _tenant_spec(tenant)) if b]
    take = submission_take(tenant)
    return [*out, take.bucket] if take else out
