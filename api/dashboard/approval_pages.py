"""Approvals on the dashboard: the queue of tool calls waiting for a person across tasks, and
approve / edit / reject — the same decision as ``POST /v1/tasks/{id}/approvals/{call_id}``,
recorded as made from the dashboard by the session's key."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy import select

from api.dashboard.auth import PATH, CheckedLogin, CurrentLogin
from api.dashboard.pages import scope_of
from api.dashboard.render import page
from shared.actions import approvals
from shared.actions.effects import after_commit
from shared.errors import InvalidRequest, RatchetError
from shared.ops import search
from shared.ops.sessions import Login
from shared.statuses import Decision, TaskStatus
from shared.store.db import get_sessionmaker
from shared.store.tables import Task

router = APIRouter(prefix=PATH, include_in_schema=False)
QUEUE = 100  # waiting tasks shown, the longest-waiting first


def _queue(login: Login) -> dict[str, Any]:
    query = select(Task).where(Task.status == TaskStatus.AWAITING_APPROVAL)
    tenant_id = scope_of(login)
    if tenant_id is not None:
        query = query.where(Task.tenant_id == tenant_id)
    with get_sessionmaker()() as session, session.begin():
        rows = session.scalars(query.order_by(Task.updated_at).limit(QUEUE)).all()
        names = search.tenant_names(session, [t.tenant_id for t in rows])
    return {"waiting": rows, "tenants": names}


@router.get("/approvals", response_class=HTMLResponse)
async def approvals_page(request: Request, login: CurrentLogin) -> Response:
    data = await run_in_threadpool(_queue, login)
    return page(request, "approvals.html", login, **data)


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest("arguments", f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequest("arguments", "a JSON object")
    return value


def _decide(login: Login, task_id: str, call_id: str, form: dict[str, str]) -> str:
    decision = form.get("decision", "")
    if decision not in tuple(Decision):
        raise InvalidRequest("decision", "approve, edit or reject")
    arguments = _arguments(form.get("arguments", "")) if decision == Decision.EDIT else None
    tenant_id = scope_of(login)
    with get_sessionmaker()() as session:
        decided, effects = approvals.decide(
            session,
            task_id,
            call_id,
            decision=decision,
            decided_by=f"key:{login.principal.key_id} (dashboard)",
            tenant_id=tenant_id,
            arguments=arguments,
            reason=form.get("reason", "").strip()[:2000] or None,
        )
    if decided.replayed:
        return f"Call {call_id} had already been decided: {decided.call.decision}"
    after_commit(effects)
    return f"Call {call_id}: {decision} recorded" + (
        " — the task runs on" if decided.resumed else ""
    )


@router.post("/tasks/{task_id}/approvals/{call_id}")
async def decide_call(
    request: Request, login: CheckedLogin, task_id: str, call_id: str
) -> Response:
    form = {k: str(v) for k, v in (await request.form()).items()}
    try:
        flash = await run_in_threadpool(_decide, login, task_id, call_id, form)
    except RatchetError as exc:
        flash = f"Not decided: {exc}"
    back = form.get("back") or f"{PATH}/tasks/{task_id}"
    if not back.startswith(PATH):
        back = PATH
    return RedirectResponse(f"{back}?{urlencode({'flash': flash})}", status_code=303)
