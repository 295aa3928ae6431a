"""The overview and the rate-limit page: what the fleet (or the tenant) is doing now."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, Response

from api.dashboard.auth import PATH, CurrentLogin, OperatorLogin
from api.dashboard.render import page
from shared.actions import limits as limit_actions
from shared.actions.limits import Concurrency
from shared.ops import fleet, overview
from shared.ops.sessions import Login
from shared.ratelimit.buckets import LimiterUnavailable
from shared.ratelimit.rules import configured_buckets, tenant_buckets
from shared.store.db import get_sessionmaker

router = APIRouter(prefix=PATH, include_in_schema=False)


def scope_of(login: Login) -> str | None:
    """Whose data a session reads: every tenant's for an operator, else its own tenant's."""
    return None if login.operator else login.principal.tenant_id


def read_overview(login: Login, window: str) -> dict[str, Any]:
    with get_sessionmaker()() as session, session.begin():
        return overview.overview(session, scope_of(login), window=window)


def rate_limits(login: Login) -> dict[str, Any]:
    """The buckets a session may see, or an ``unavailable`` reason if Redis is down."""
    try:
        if login.operator:
            return limit_actions.read_buckets(configured_buckets())
        name = login.principal.tenant_name
        return limit_actions.read_buckets(tenant_buckets(name), scope_prefix=f"tenant:{name}:")
    except LimiterUnavailable as exc:
        return {"buckets": [], "blocked": [], "unavailable": str(exc)}


def pressure(limits: dict[str, Any]) -> dict[str, Any]:
    """One line for the overview: how many buckets are nearly empty, and pauses in force."""
    low = [b for b in limits["buckets"] if b["capacity"] and b["level"] / b["capacity"] < 0.2]
    paused = len(limits["blocked"])
    if "unavailable" in limits:
        summary = "rate limiter unavailable"
    else:
        summary = f"{len(low)} of {len(limits['buckets'])} buckets under 20%, {paused} paused"
    return {"summary": summary, "low": low, "paused": paused}


@router.get("", response_class=HTMLResponse)
async def overview_page(
    request: Request, login: CurrentLogin, window: Literal["1h", "24h"] = "1h"
) -> Response:
    data = await run_in_threadpool(read_overview, login, window)
    limits = await run_in_threadpool(rate_limits, login)
    fleet = await run_in_threadpool(fleet_summary) if login.operator else None
    return page(request, "overview.html", login, o=data, pressure=pressure(limits), fleet=fleet)


@router.get("/ratelimits", response_class=HTMLResponse)
async def rate_limits_page(request: Request, login: CurrentLogin) -> Response:
    limits = await run_in_threadpool(rate_limits, login)
    concurrency = await run_in_threadpool(_concurrency) if login.operator else None
    return page(request, "ratelimits.html", login, limits=limits, concurrency=concurrency)


def _concurrency() -> Concurrency:
    with get_sessionmaker()() as session:
        return limit_actions.read_concurrency(session)


def fleet_summary() -> dict[str, Any] | None:
    """Workers, busy slots and queues for the overview; None if Redis does not answer."""
    try:
        with get_sessionmaker()() as session, session.begin():
            live = fleet.view(session)
    except fleet.FleetUnavailable:
        return None
    return {
        "workers": live.workers,
        "busy": sum(w.busy for w in live.workers),
        "slots": sum(w.threads for w in live.workers),
        "queues": [
            {"name": q.name, "depth": q.depth, "oldest_age_seconds": _seconds(q.oldest_age_ms)}
            for q in live.queues
        ],
        "view": live,
    }


def _seconds(ms: int | None) -> float | None:
    return None if ms is None else round(ms / 1000, 1)


@router.get("/workers", response_class=HTMLResponse)
async def workers_page(request: Request, login: OperatorLogin) -> Response:
    summary = await run_in_threadpool(fleet_summary)
    return page(request, "workers.html", login, fleet=summary, now=time.time())
