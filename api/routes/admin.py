"""Rate-limit views: ``/v1/admin/*`` is the operator's fleet-wide view (``operator`` scope);
``/v1/ratelimits`` shows a tenant admin its own tenant's buckets and nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, HTTPException

from api.deps import Admin, Operator
from api.problems import responses
from shared.ratelimit.buckets import Bucket, LimiterUnavailable
from shared.ratelimit.limiter import get_limiter
from shared.ratelimit.limits import adaptive_share, configured_buckets, tenant_buckets
from shared.settings import get_settings

router = APIRouter(tags=["admin"])


def view(buckets: Sequence[Bucket], *, scope_prefix: str = "") -> dict[str, Any]:
    """Each bucket's capacity, level and last five minutes' decisions, waits and provider
    429s; plus the scopes (starting with ``scope_prefix``) a provider 429 has paused."""
    limiter = get_limiter()
    try:
        snapshot = limiter.snapshot(buckets)
        blocked = limiter.blocked()
        if get_settings().rate_limit_adaptive:  # the share its 429s have left each model
            for bucket in snapshot:
                scope = bucket["scope"]
                if scope.startswith("model:") and "*" not in scope:
                    bucket["adaptive_share"] = adaptive_share(scope.rsplit(":", 1)[0])
    except LimiterUnavailable as exc:
        raise HTTPException(503, str(exc)) from exc
    return {
        "buckets": snapshot,
        "blocked": [
            {"scope": s, "remaining_ms": ms}
            for s, ms in sorted(blocked.items())
            if s.startswith(scope_prefix)
        ],
    }


LIMITER_DOWN = responses(
    {503: "the database or the rate limiter (Redis) is unavailable; retry shortly"}
)


@router.get(
    "/v1/admin/ratelimits",
    summary="The fleet's rate-limit buckets (operator)",
    responses=LIMITER_DOWN,
)
def fleet_rate_limits(_: Operator) -> dict[str, Any]:
    """Every configured bucket of the fleet, every tenant's included (operator scope)."""
    return view(configured_buckets())


@router.get(
    "/v1/ratelimits", summary="The tenant's rate-limit buckets (admin)", responses=LIMITER_DOWN
)
def tenant_rate_limits(principal: Admin) -> dict[str, Any]:
    """The caller's tenant's own buckets (admin scope); never another tenant's."""
    name = principal.tenant_name
    return view(tenant_buckets(name), scope_prefix=f"tenant:{name}:")
