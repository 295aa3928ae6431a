"""Which rate-limit buckets apply to a model call or a submission, from settings and a file.

``RATCHET_RATE_LIMITS`` (JSON) or ``RATCHET_RATE_LIMITS_FILE`` (TOML) — the env wins on a clash::

    [models."openai:gpt-4o-mini"]     # or "openai:*" for every model of a provider
    requests = 500                    # per `per_seconds` (default 60)
    tokens = 200000
    [tenants."*"]                     # every tenant; a tenant's own name overrides
    requests = 60
    tokens = 100000
    submissions = 120                 # POST /v1/tasks per `per_seconds`

Token costs are estimated before the call (about four characters a token, plus the call's
``max_tokens`` if set) and corrected with the provider's reported usage afterwards.
"""

from __future__ import annotations

import tomllib
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from shared.rate_limiter import Bucket, Take
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


@lru_cache
def _load(file: Path | None, inline: str) -> LimitsConfig:
    data: dict[str, dict[str, dict[str, object]]] = {"models": {}, "tenants": {}}
    if file is not None:
        loaded = tomllib.loads(file.read_text())
        for section in ("models", "tenants"):
            data[section].update(loaded.get(section, {}))
    if inline:
        extra = LimitsConfig.model_validate_json(inline)
        data["models"].update({k: v.model_dump() for k, v in extra.models.items()})
        data["tenants"].update({k: v.model_dump() for k, v in extra.tenants.items()})
    return LimitsConfig.model_validate(data)


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


def call_takes(model: str, tenant: str, estimated_tokens: int) -> list[Take]:
    """Every bucket a model call must pass, with what it costs each."""
    takes = []
    for scope, spec in (
        (f"model:{model}", _model_spec(model)),
        (f"tenant:{tenant}", _tenant_spec(tenant)),
    ):
        requests, tokens = _buckets(scope, spec)
        if requests:
            takes.append(Take(requests, 1))
        if tokens:
            takes.append(Take(tokens, estimated_tokens))
    return takes


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
