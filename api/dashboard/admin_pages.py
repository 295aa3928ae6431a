"""Webhook endpoints (enable, disable, delete, add), tenants with their usage today, and API
keys (create, revoke). A tenant admin sees and changes only its own tenant's; an operator
sees every tenant's. Keys made here never carry the ``operator`` scope (only the CLI grants
it), and a revoked key is refused by the API at once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy.orm import Session

from api.dashboard.auth import PATH, CheckedLogin, CurrentLogin
from api.dashboard.pages import scope_of
from api.dashboard.render import page
from api.deps import verified_keys
from shared.actions import keys as key_actions
from shared.actions import webhooks as webhook_actions
from shared.errors import InvalidRequest, RatchetError
from shared.ops import overview, search
from shared.ops.sessions import Login
from shared.store import tenants
from shared.store.backends import plan_with_values
from shared.store.db import get_sessionmaker
from shared.store.events import EVENT_TYPES
from shared.store.tables import WebhookEndpoint, utcnow
from shared.webhooks import deliveries as webhook_deliveries
from shared.webhooks import endpoints

router = APIRouter(prefix=PATH, include_in_schema=False)
KEY_SCOPES = tuple(tenants.TENANT_SCOPES)


def _back(path: str, flash: str) -> RedirectResponse:
    return RedirectResponse(f"{PATH}/{path}?{urlencode({'flash': flash})}", status_code=303)


def _webhooks(login: Login) -> dict[str, Any]:
    with get_sessionmaker()() as session, session.begin():
        plan_with_values(session)  # the success rates read a time window
        rows = endpoints.list_for(session, scope_of(login), limit=500)
        rates = endpoints.success_rates(session, [e.id for e in rows], utcnow() - timedelta(days=1))
        failing = webhook_deliveries.failing(session, scope_of(login))
        owners = [e.tenant_id for e in rows] + [d.tenant_id for d in failing]
        names = search.tenant_names(session, owners)
    return {
        "endpoints": rows,
        "rates": rates,
        "failing": failing,
        "tenants": names,
        "event_types": EVENT_TYPES,
    }


@router.get("/webhooks", response_class=HTMLResponse)
async def webhooks_page(request: Request, login: CurrentLogin) -> Response:
    data = await run_in_threadpool(_webhooks, login)
    return page(request, "webhooks.html", login, **data)


def _endpoint_tenant(session: Session, login: Login, endpoint_id: str) -> str:
    """The endpoint's tenant, if this session may change it (NotFound otherwise)."""
    if login.operator:
        row = session.get(WebhookEndpoint, endpoint_id)
        if row is not None:
            return row.tenant_id
    return login.principal.tenant_id


def _change_endpoint(login: Login, endpoint_id: str, action: str) -> str:
    who = f"disabled from the dashboard by key {login.principal.key_id}"
    with get_sessionmaker()() as session:
        with session.begin():
            tenant_id = _endpoint_tenant(session, login, endpoint_id)
        if action == "delete":
            webhook_actions.remove_endpoint(session, tenant_id, endpoint_id)
            return "Endpoint deleted"
        enabled = action == "enable"
        webhook_actions.enable_endpoint(session, tenant_id, endpoint_id, enabled, reason=who)
    return f"Endpoint {action}d"


@router.post("/webhooks/{endpoint_id}/{action}")
async def change_endpoint(login: CheckedLogin, endpoint_id: str, action: str) -> Response:
    if action not in ("enable", "disable", "delete"):
        return _back("webhooks", f"no action {action!r}")
    try:
        flash = await run_in_threadpool(_change_endpoint, login, endpoint_id, action)
    except RatchetError as exc:
        flash = str(exc)
    return _back("webhooks", flash)


def _add_endpoint(login: Login, url: str, events: list[str]) -> str:
    with get_sessionmaker()() as session:
        webhook_actions.add_endpoint(session, login.principal.tenant_id, url=url, events=events)
    return "Endpoint added"


@router.post("/webhooks")
async def add_endpoint(request: Request, login: CheckedLogin) -> Response:
    form = await request.form()
    events = [str(e) for e in form.getlist("events")] or list(endpoints.DEFAULT_EVENTS)
    try:
        flash = await run_in_threadpool(_add_endpoint, login, str(form.get("url") or ""), events)
    except RatchetError as exc:
        flash = f"Not added: {exc}"
    return _back("webhooks", flash)


def _tenants(login: Login) -> dict[str, Any]:
    midnight = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    with get_sessionmaker()() as session, session.begin():
        keys = tenants.list_keys(session, login.principal.tenant_id, limit=500)
        if not login.operator:
            return {"keys": keys, "tenants": [], "usage": {}}
        plan_with_values(session)
        usage = overview.usage(session, None, since=midnight, by="tenant")
        rows = tenants.list_tenants(session)
    return {"keys": keys, "tenants": rows, "usage": {u["tenant"]: u for u in usage}}


@router.get("/tenants", response_class=HTMLResponse)
async def tenants_page(request: Request, login: CurrentLogin) -> Response:
    data = await run_in_threadpool(_tenants, login)
    created = request.query_params.get("created")  # never a key: only its prefix
    return page(request, "tenants.html", login, scopes=KEY_SCOPES, created=created, **data)


def _create_key(login: Login, name: str | None, scopes: list[str]) -> tuple[str, str]:
    if not set(scopes) <= set(KEY_SCOPES):
        raise InvalidRequest("scopes", "the dashboard grants only tenant scopes")
    with get_sessionmaker()() as session:
        row, key = key_actions.create_key(
            session, login.principal.tenant_id, scopes=scopes, name=name or None
        )
    return row.prefix, key


@router.post("/keys", response_class=HTMLResponse)
async def create_key(request: Request, login: CheckedLogin) -> Response:
    """The new key is shown on this response's page, once; it is never put in a URL."""
    form = await request.form()
    scopes = [str(s) for s in form.getlist("scopes")] or list(tenants.DEFAULT_SCOPES)
    name = str(form.get("name") or "").strip()[:100]
    try:
        prefix, key = await run_in_threadpool(_create_key, login, name, scopes)
    except RatchetError as exc:
        return _back("tenants", f"Not created: {exc}")
    data = await run_in_threadpool(_tenants, login)
    return page(
        request, "tenants.html", login, scopes=KEY_SCOPES, created=prefix, new_key=key, **data
    )


def _revoke(login: Login, key_id: str) -> str:
    with get_sessionmaker()() as session:
        row = key_actions.revoke_key(
            session, login.principal.tenant_id, key_id, operator=login.operator
        )
    verified_keys.forget(key_id)
    return f"Key {row.prefix}… revoked"


@router.post("/keys/{key_id}/revoke")
async def revoke_key(login: CheckedLogin, key_id: str) -> Response:
    try:
        flash = await run_in_threadpool(_revoke, login, key_id)
    except RatchetError as exc:
        flash = str(exc)
    return _back("tenants", flash)
