"""The FastAPI application. ``ratchet api`` serves it with uvicorn."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import RedirectResponse
from fastapi.security import HTTPBearer
from fastapi_offline import FastAPIOffline

from api import dashboard, docs_pages, favicon, problems
from api.body_limit import BodyLimitMiddleware
from api.body_text import BodyTextMiddleware
from api.deps import connection_turns
from api.event_hub import hub
from api.params import reject_nul
from api.problems import REASONS, Problem, responses
from api.routes import (
    agents,
    approvals,
    batches,
    events,
    fleet,
    forks,
    health,
    keys,
    limits,
    mcp_servers,
    overview,
    schedules,
    secrets,
    tasks,
    thread_events,
    threads,
    waits,
    webhook_endpoints,
    webhooks,
)
from api.schemas.batches import document_batch
from api.schemas.fields import forbid_nul_in_request_bodies
from api.schemas.tasks import document_submission
from api.schemas.threads import document_turn
from api.security_headers import SecurityHeadersMiddleware
from api.shutdown import on_exit_signal
from api.url_credentials import UrlCredentialsMiddleware
from shared.agents.registry import get_registry
from shared.observability import logs
from shared.settings import get_settings
from shared.store.db import require_migrated
from shared.webhooks import egress


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    require_migrated()  # refuse to serve on a schema older than the code
    app.state.connection_turns = connection_turns(get_settings())
    egress.warn_if_open(get_settings())
    get_registry()
    await hub.start()
    # At SIGTERM an open event stream ends with a last event, instead of holding the stop.
    restore_signals = on_exit_signal(hub.close)
    # What is loaded by now (the app, its schemas, the registry, the ORM's mappers) lives as
    # long as the process: frozen, out of the cycle collector's sight, so that a full
    # collection no longer walks it. Under load those walks paused every request in flight
    # for tens of milliseconds, most of the API's p99 (``ratchet bench api``).
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        restore_signals()
        await hub.stop()


DESCRIPTION = """\
Submit an agent task and get `202 Accepted` with its id at once; workers run it step by step,
committing every step, and the result comes back by polling (`GET /v1/tasks/{id}?wait=N`), by
a server-sent event stream, or by signed webhooks.

Authenticate every `/v1` request with `Authorization: Bearer <api key>` (never in the URL).
Every error is an RFC 9457 `application/problem+json` document (`Problem`).
"""
# Only for the OpenAPI document (FastAPI names it on every operation below it): the key
# itself is read, strictly, by api/deps.py.
BEARER = HTTPBearer(
    scheme_name="apiKey",
    description="an API key: `ratchet tenants create NAME` or `POST /v1/keys`",
    auto_error=False,
)
REFS = "#/components/schemas/{model}"
# What any request may be answered, whatever its route: before a route is even chosen.
ANY_REQUEST = responses(
    {
        400: "an API key in the query string",
        413: REASONS[413],
        422: "a path or query parameter, or a string in the body, holds a NUL character "
        "(or a lone surrogate), or is invalid",
        431: REASONS[431],
    }
)
# ... and what any request that carries an API key may be answered besides.
AUTHENTICATED = responses(REASONS) | {status: ANY_REQUEST[status] for status in (413, 431)}
AUTHENTICATED.pop(404)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the submit body (which the route parses itself, after auth) and
    the problem schema every error answer uses."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title,
            version=app.version,
            summary=app.summary,
            description=app.description,
            routes=app.routes,
            tags=TAGS,
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        document_submission(components)
        document_turn(components)
        document_batch(components)
        components["Problem"] = Problem.model_json_schema(ref_template=REFS)
        components.update(components["Problem"].pop("$defs", {}))
        forbid_nul_in_request_bodies(schema)
        app.openapi_schema = schema
    return app.openapi_schema


TAGS = [
    {"name": "tasks", "description": "Submit tasks, read them, cancel and retry them."},
    {"name": "events", "description": "A task's events as a server-sent event stream."},
    {"name": "webhooks", "description": "Webhook deliveries and the signing secret."},
    {"name": "webhook-endpoints", "description": "A tenant admin's default webhook endpoints."},
    {"name": "agents", "description": "The registered agents and their tools."},
    {"name": "keys", "description": "A tenant admin's API keys."},
    {"name": "schedules", "description": "Tasks submitted on a cron expression, a tenant's own."},
    {"name": "threads", "description": "Conversations whose turns are tasks, and their history."},
    {
        "name": "admin",
        "description": "Overviews, the fleet, task search and rate limits (operator or tenant).",
    },
    {"name": "health", "description": "Liveness and readiness; no API key."},
]


async def _root() -> RedirectResponse:
    # A browser opening the bare URL finds the dashboard (the API's docs are at /docs).
    return RedirectResponse("/dashboard", status_code=307)


def create_app() -> FastAPI:
    logs.configure_from_settings(replace=False)  # each API process (--workers spawns them)
    # The docs pages (Swagger UI at /docs, ReDoc at /redoc: api/docs_pages.py) with their
    # assets served from the package, not a CDN: they work offline and behind a firewall.
    app = FastAPIOffline(
        redoc_url=None,
        favicon_url="/favicon.ico",
        # Swagger UI would fetch a validity badge from validator.swagger.io: nothing leaves.
        swagger_ui_parameters={"validatorUrl": None},
        title="Ratchet",
        version="1",
        summary="Durable LLM agent tasks: submit, run step by step, get the result.",
        description=DESCRIPTION,
        lifespan=lifespan,
        dependencies=[Depends(reject_nul)],
    )
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    problems.install(app)
    app.add_middleware(BodyTextMiddleware)  # NUL or lone surrogates in any body: a 422
    app.add_middleware(BodyLimitMiddleware, max_bytes=get_settings().max_request_bytes)
    app.add_middleware(UrlCredentialsMiddleware)  # before anything reads the URL
    app.add_middleware(SecurityHeadersMiddleware)  # outermost: on every answer, refusals too
    # The API's routes first, the busiest first: a request is matched against the routes in
    # the order they were added (no two of these groups share a path).
    for router in (
        tasks,
        events,
        approvals,
        webhooks,
        agents,
        limits,
        keys,
        webhook_endpoints,
        fleet,
        overview,
        schedules,
        forks,
        threads,
        thread_events,
        waits,
        batches,
        secrets,
        mcp_servers,
    ):
        app.include_router(router.router, responses=AUTHENTICATED, dependencies=[Depends(BEARER)])
    app.include_router(health.router, responses=ANY_REQUEST)
    app.add_api_route("/", _root, include_in_schema=False)
    favicon.install(app)
    docs_pages.install(app)
    dashboard.install(app)
    return app
