"""``/v1/admin``: operator views across tenants (admin scope)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException

from api.deps import Admin
from shared.limits import adaptive_share, configured_buckets
from shared.rate_limiter import LimiterUnavailable, get_limiter
from shared.settings import get_settings

router = APIRouter(prefix="/v1/admin", tags=["admin"])


@router.get("/ratelimits")
def rate_limits(_: Admin) -> dict[str, Any]:
    """Every configured bucket: capacity, current level, and the last five minutes' decisions,
    waits and provider 429s; plus the scopes a provider 429 has paused right now."""
    limiter = get_limiter()
    try:
        buckets = limiter.snapshot(configured_buckets())
        blocked = limiter.blocked()
        if get_settings().rate_limit_adaptive:  # the share its 429s have left each model
            for bucket in buckets:
                scope = bucket["scope"]
                if scope.startswith("model:") and "*" not in scope:
                    bucket["adaptive_share"] = adaptive_share(scope.rsplit(":", 1)[0])
    except LimiterUnavailable as exc:
        raise HTTPException(503, str(exc)) from exc
    return {
        "buckets": buckets,
        "blocked": [{"scope": s, "remaining_ms": ms} for s, ms in sorted(blocked.items())],
    }
