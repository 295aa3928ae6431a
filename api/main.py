"""The FastAPI application. ``ratchet api`` serves it with uvicorn."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from api import problems
from api.body_limit import BodyLimitMiddleware
from api.event_hub import hub
from api.routes import admin, agents, events, health, tasks, webhooks
from api.schemas import TaskCreate
from shared import logs
from shared.db import require_migrated
from shared.registry import get_registry
from shared.settings import get_settings


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    require_migrated()  # refuse to serve on a schema older than the code
    get_registry()
    await hub.start()
    try:
        yield
    finally:
        await hub.stop()


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the submit body, which the route parses itself (after auth)."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, summary=app.summary, routes=app.routes
        )
        body = TaskCreate.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(body.pop("$defs", {}))
        components["TaskCreate"] = body
        app.openapi_schema = schema
    return app.openapi_schema


def create_app() -> FastAPI:
    logs.configure_from_settings(replace=False)  # each API process (--workers spawns them)
    app = FastAPI(
        title="Ratchet",
        version="1",
        summary="Durable LLM agent tasks: submit, run step by step, get the result.",
        lifespan=lifespan,
    )
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    problems.install(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=get_settings().max_request_bytes)
    app.include_router(health.router)
    app.include_router(tasks.router)
    app.include_router(events.router)
    app.include_router(webhooks.router)
    app.include_router(agents.router)
    app.include_router(admin.router)
    return app
