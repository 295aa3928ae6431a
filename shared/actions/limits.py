"""What an operator can do about the fleet's limits: read the rate-limit buckets and the
concurrency limits in force with their use, and set or remove a concurrency limit at runtime
(the whole fleet follows within a second). Over the API and on the dashboard alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from shared.errors import NotFound
from shared.ratelimit.buckets import Bucket
from shared.ratelimit.limiter import get_limiter
from shared.ratelimit.rules import adaptive_share
from shared.scheduling import admission, concurrency
from shared.settings import get_settings
from shared.store.tables import ConcurrencyLimit


def read_buckets(buckets: Sequence[Bucket], *, scope_prefix: str = "") -> dict[str, Any]:
    """Each bucket's capacity, level and last five minutes' decisions, waits and provider
    429s; plus the scopes (starting with ``scope_prefix``) a provider 429 has paused.
    LimiterUnavailable when the limiter's store does not answer."""
    limiter = get_limiter()
    snapshot = limiter.snapshot(buckets)
    blocked = limiter.blocked()
    if get_settings().rate_limit_adaptive:  # the share its 429s have left each model
        for bucket in snapshot:
            scope = bucket["scope"]
            if scope.startswith("model:") and "*" not in scope:
                bucket["adaptive_share"] = adaptive_share(scope.rsplit(":", 1)[0])
    return {
        "buckets": snapshot,
        "blocked": [
            {"scope": s, "remaining_ms": ms}
            for s, ms in sorted(blocked.items())
            if s.startswith(scope_prefix)
        ],
    }


@dataclass(frozen=True)
class Limit:
    """A concurrency limit in force: from the configuration, or set at runtime (by whom,
    when)."""

    kind: str
    name: str
    spec: dict[str, Any]
    source: str  # "runtime" or "configuration"
    updated_by: str | None = None
    updated_at: datetime | None = None


@dataclass(frozen=True)
class Use:
    running: int  # admitted now: running, or its message on the way
    waiting: int = 0  # in the backlog (tenants only)
    queued: int = 0  # of those waiting, how many never started (tenants only)


@dataclass(frozen=True)
class Concurrency:
    """The limits in force and what each tenant, agent and pool holds now."""

    fair_scheduling: bool
    limits: list[Limit]
    tenants: dict[str, Use] = field(default_factory=dict)
    agents: dict[str, Use] = field(default_factory=dict)
    pools: dict[str, Use] = field(default_factory=dict)
    admitted: int = 0  # tasks admitted fleet-wide
    in_queue: int = 0  # of which still a message in the broker


def _limit(kind: str, name: str, spec: Any, row: ConcurrencyLimit | None) -> Limit:
    return Limit(
        kind=kind,
        name=name,
        spec=spec.model_dump(),
        source="runtime" if row is not None else "configuration",
        updated_by=row.updated_by if row else None,
        updated_at=row.updated_at.replace(tzinfo=row.updated_at.tzinfo or UTC) if row else None,
    )


def read_concurrency(session: Session) -> Concurrency:
    """Every limit in force and its use, tenants with their backlog; one transaction."""
    with session.begin():
        in_force = concurrency.in_force(session)
        rows = {(r.kind, r.name): r for r in session.query(ConcurrencyLimit).all()}
        use = admission.in_use(session, in_force)
        backlog = admission.backlog_by_tenant(session)
    tenant_names = sorted(set(use.tenants) | set(backlog))
    return Concurrency(
        fair_scheduling=get_settings().fair_scheduling,
        limits=[
            _limit(kind, name, spec, rows.get((kind, name)))
            for kind in concurrency.KINDS
            for name, spec in sorted(getattr(in_force.config, kind).items())
        ],
        tenants={name: Use(use.tenants[name], *backlog.get(name, (0, 0))) for name in tenant_names},
        agents={name: Use(running=n) for name, n in sorted(use.agents.items())},
        pools={name: Use(running=use.pools[name]) for name in sorted(in_force.config.pools)},
        admitted=use.total,
        in_queue=use.in_queue,
    )


def set_limit(session: Session, kind: str, name: str, spec: dict[str, Any], *, by: str) -> Limit:
    """Override the configured limit of that kind and name (the whole entry) for the fleet
    (InvalidRequest for a spec its kind refuses)."""
    with session.begin():
        row = concurrency.set_override(session, kind, name, spec, by=by)
        return _limit(kind, name, concurrency.SPECS[kind].model_validate(row.spec), row)


def remove_limit(session: Session, kind: str, name: str) -> None:
    """The configured limit (if any) applies again (NotFound if none was set at runtime)."""
    with session.begin():
        if not concurrency.delete_override(session, kind, name):
            raise NotFound(f"no runtime limit for {kind} {name!r}")
