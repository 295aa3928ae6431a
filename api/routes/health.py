"""Liveness and readiness."""

from __future__ import annotations

import hmac
import os
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from sqlalchemy import text

from api.deps import bearer_key, get_principal, require
from api.problems import problem, responses
from shared.settings import get_settings
from shared.store.db import get_engine, require_migrated
from shared.store.tenants import OPERATOR
from shared.transport import get_transport

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness")
async def healthz() -> dict[str, str]:
    """The process is up. ``async`` and touching nothing: it answers while the database is
    down and every worker thread is busy waiting for it."""
    return {"status": "ok"}


async def metrics_reader(request: Request) -> None:
    """The scraper: ``Authorization: Bearer`` with ``RATCHET_METRICS_TOKEN`` (checked in
    constant time, no database), or an API key with the ``operator`` scope. The metrics name
    every tenant's agents and models and their volumes, so they are an operator's to read."""
    token = get_settings().metrics_token
    if token is not None and hmac.compare_digest(
        bearer_key(request).encode(), token.get_secret_value().encode()
    ):
        return
    await require(OPERATOR)(await get_principal(request))


@router.get("/metrics", response_class=Response, include_in_schema=False)
def metrics(_: Annotated[None, Depends(metrics_reader)]) -> Response:
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
    checks.update(get_transport().readiness())
    if all(v == "ok" for v in checks.values()):
        return {"status": "ok", "checks": checks}
    return problem(
        503, "not ready: " + ", ".join(f"{k} {v}" for k, v in checks.items()), checks=checks
    )
