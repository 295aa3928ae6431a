"""Concurrency limits and queue caps: how many steps a tenant, an agent or a pool of tasks may
run at once, and how many tasks a tenant may have queued.

``RATCHET_CONCURRENCY`` (JSON) or ``RATCHET_CONCURRENCY_FILE`` (TOML) — the env wins on a
clash — and, over both, what an operator set at runtime (``PUT /v1/admin/concurrency/...``,
stored with who and when)::

    [tenants."*"]              # every tenant; a tenant's own name overrides
    max_running = 50           # steps running (admitted) at once
    max_queued = 10000         # tasks queued; past it, a submission is a 429
    weight = 1                 # its turns in each round of admission
    [tenants.acme]
    max_running = 3
    [agents.support]           # across every tenant
    max_running = 20
    [pools.openai]             # tasks whose model matches (and agent, tenant, if given)
    models = ["openai:*"]
    max_running = 200

Only admitted steps count: a task waiting in the backlog, for a rate-limit token, a retry
backoff or an approval holds no slot.

A tenant the operator set no ``max_running`` for (nor a ``*`` one) still holds at most
``RATCHET_TENANT_DEFAULT_SHARE`` of the fleet's slots (the dispatcher turns the share into
slots, see :meth:`Limits.max_running`): admitted tasks keep their slots until they end or
wait, so without it one tenant's flood of slow tasks would hold every slot, and the others'
tasks would wait for its steps to end however fairly the backlog is ordered.
"""

from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from shared import configfile
from shared.errors import InvalidRequest
from shared.settings import get_settings
from shared.store.tables import ConcurrencyLimit, utcnow

Kind = Literal["tenants", "agents", "pools"]
KINDS: tuple[Kind, ...] = ("tenants", "agents", "pools")


class TenantLimit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_running: int | None = Field(None, ge=1, le=1_000_000)
    max_queued: int | None = Field(None, ge=0, le=100_000_000)
    weight: int = Field(1, ge=1, le=100)


class AgentLimit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_running: int = Field(ge=1, le=1_000_000)


class PoolLimit(BaseModel):
    """A pool: the tasks whose model, agent and tenant match its patterns (each list that is
    given must match; shell-style patterns such as ``openai:*``)."""

    model_config = ConfigDict(extra="forbid")

    max_running: int = Field(ge=1, le=1_000_000)
    models: list[str] = Field(default_factory=list, max_length=100)
    agents: list[str] = Field(default_factory=list, max_length=100)
    tenants: list[str] = Field(default_factory=list, max_length=100)

    def holds(self, *, tenant: str, agent: str, model: str) -> bool:
        return all(
            not patterns or any(fnmatch.fnmatchcase(value, p) for p in patterns)
            for patterns, value in (
                (self.models, model),
                (self.agents, agent),
                (self.tenants, tenant),
            )
        )


SPECS: dict[str, type[BaseModel]] = {
    "tenants": TenantLimit,
    "agents": AgentLimit,
    "pools": PoolLimit,
}


class ConcurrencyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: dict[str, TenantLimit] = Field(default_factory=dict)
    agents: dict[str, AgentLimit] = Field(default_factory=dict)
    pools: dict[str, PoolLimit] = Field(default_factory=dict)


def parse_inline(text: str) -> ConcurrencyConfig:
    """``RATCHET_CONCURRENCY``; ValueError naming what is wrong."""
    return configfile.parse_inline(ConcurrencyConfig, text)


def parse_file(file: Path) -> ConcurrencyConfig:
    """``RATCHET_CONCURRENCY_FILE``; ValueError naming what is wrong."""
    return configfile.parse_file(ConcurrencyConfig, file)


@lru_cache
def _configured(file: Path | None, inline: str) -> ConcurrencyConfig:
    config = parse_file(file) if file is not None else ConcurrencyConfig()
    if inline:
        extra = parse_inline(inline)
        config = ConcurrencyConfig(
            tenants={**config.tenants, **extra.tenants},
            agents={**config.agents, **extra.agents},
            pools={**config.pools, **extra.pools},
        )
    return config


def configured() -> ConcurrencyConfig:
    """The settings' and the file's limits (no runtime overrides)."""
    settings = get_settings()
    return _configured(settings.concurrency_file, settings.concurrency)


@dataclass(frozen=True)
class Limits:
    """The limits in force: the configured ones with the runtime overrides over them."""

    config: ConcurrencyConfig
    overridden: frozenset[tuple[str, str]] = frozenset()

    def tenant(self, name: str) -> TenantLimit:
        tenants = self.config.tenants
        return tenants.get(name) or tenants.get("*") or TenantLimit()

    def max_running(self, tenant: str, *, share: int | None) -> int | None:
        """The most tasks ``tenant`` may have admitted at once: its own (or ``*``'s)
        ``max_running`` when the operator set one, else ``share``, the default share of the
        fleet in slots (None: no default)."""
        own = self.tenant(tenant).max_running
        return own if own is not None else share

    def agent(self, name: str) -> AgentLimit | None:
        return self.config.agents.get(name) or self.config.agents.get("*")

    def pools_of(self, *, tenant: str, agent: str, model: str) -> list[str]:
        return [
            name
            for name, pool in self.config.pools.items()
            if pool.holds(tenant=tenant, agent=agent, model=model)
        ]

    def governs(self, *, tenant: str, agent: str, model: str) -> bool:
        """Whether a task of ``tenant``'s, ``agent`` and ``model`` falls under any limit."""
        return (
            self.tenant(tenant).max_running is not None
            or self.agent(agent) is not None
            or bool(self.pools_of(tenant=tenant, agent=agent, model=model))
        )

    @property
    def any_running_limit(self) -> bool:
        return bool(self.config.agents or self.config.pools) or any(
            t.max_running for t in self.config.tenants.values()
        )


def in_force(session: Session) -> Limits:
    """The limits in force now, read with the runtime overrides."""
    base = configured()
    merged: dict[str, dict[str, Any]] = {
        "tenants": dict(base.tenants),
        "agents": dict(base.agents),
        "pools": dict(base.pools),
    }
    overridden = set()
    for row in session.scalars(select(ConcurrencyLimit)):
        if row.kind in merged:
            merged[row.kind][row.name] = SPECS[row.kind].model_validate(row.spec)
            overridden.add((row.kind, row.name))
    return Limits(ConcurrencyConfig.model_validate(merged), frozenset(overridden))


CACHE_SECONDS = 1.0
_cache: dict[str, tuple[float, Limits]] = {}


def cached(session: Session) -> Limits:
    """``in_force``, read at most once a second per process (a change at runtime applies
    within that second)."""
    fresh = peek()
    if fresh is not None:
        return fresh
    limits = in_force(session)
    _cache["limits"] = (time.monotonic(), limits)
    return limits


def peek() -> Limits | None:
    """The cached limits if they are fresh, without reading the database; else None."""
    hit = _cache.get("limits")
    if hit is not None and time.monotonic() - hit[0] < CACHE_SECONDS:
        return hit[1]
    return None


def forget_cache() -> None:
    _cache.clear()


def validate_spec(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """An operator's limit as stored; InvalidRequest naming the bad field."""
    model = SPECS.get(kind)
    if model is None:
        raise InvalidRequest("kind", f"must be one of {', '.join(KINDS)}")
    try:
        return model.model_validate(spec).model_dump(exclude_defaults=False)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or "body"
        raise InvalidRequest(field, error["msg"]) from None


def set_override(
    session: Session, kind: str, name: str, spec: dict[str, Any], *, by: str
) -> ConcurrencyLimit:
    stored = validate_spec(kind, spec)
    row = session.get(ConcurrencyLimit, (kind, name))
    if row is None:
        row = ConcurrencyLimit(kind=kind, name=name, spec=stored, updated_by=by)
        session.add(row)
    else:
        row.spec, row.updated_by, row.updated_at = stored, by, utcnow()
    session.flush()
    forget_cache()
    return row


def delete_override(session: Session, kind: str, name: str) -> bool:
    row = session.get(ConcurrencyLimit, (kind, name))
    if row is None:
        return False
    session.delete(row)
    session.flush()
    forget_cache()
    return True
