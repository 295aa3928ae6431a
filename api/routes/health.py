"""Liveness and readiness."""

from __future__ import annotations

import os

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from sqlalchemy import text

from api.problems import problem, responses
from shared.settings import get_settings
from shared.store.db import get_engine, require_migrated

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness")
async def healthz() -> dict[str, str]:
    """The process is up. ``async`` and touching nothing: it answers while the database is
    down and every worker thread is busy waiting for it."""
    return {"status": "ok"}


@router.get("/metrics", response_class=Response, include_in_schema=False)
def metrics() -> Response:
    """Prometheus metrics of the API: of every process when it runs several (``ratchet api
    --workers N`` shares a multiprocess directory), else of this one."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get(
    "/readyz",
    response_model=None,
    summary="Readiness",
    responses=responses(
        {503: "the database (or, in production, Redis) does not answer, or is not migrated"}
    ),
)
def readyz() -> dict[str, object] | JSONResponse:
    """Ready when the database (migrated) and, in production, Redis answer."""
    checks: dict[str, str] = {}
    try:
        with get_engine().connect() as conn:
            conn.execute(text("SELECT 1"))
        require_migrated()
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    settings = get_settings()
    if not settings.embedded:
        try:
            import redis

            redis.Redis.from_url(settings.redis_url, socket_timeout=2).ping()
            checks["redis"] = "ok"
        except Exception as exc:
            checks["redis"] = f"error: {type(exc).__name__}"
    if all(v == "ok" for v in checks.values()):
        return {"status": "ok", "checks": checks}
    return problem(
        503, "not ready: " + ", ".join(f"{k} {v}" for k, v in checks.items()), checks=checks
    )
