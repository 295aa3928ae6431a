"""``/approve/{token}``: an approval link. GET shows the waiting call (tool, arguments,
deadline) and asks to approve or reject it; only the POST decides, once, as ``link``. A used
link says how the call was decided; an expired one says so (410); a tampered one is refused
(403). See ``shared.approvals.links``."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, Response
from sqlalchemy import select

from api.dashboard.auth import same_origin
from api.dashboard.render import page
from shared.actions import approvals
from shared.actions.effects import after_commit
from shared.approvals.links import LinkRefused, LinkTarget, verify
from shared.errors import Conflict, NotFound
from shared.store.db import get_sessionmaker
from shared.store.tables import Task, ToolCall

router = APIRouter(include_in_schema=False)


def _read(target: LinkTarget) -> dict[str, Any]:
    with get_sessionmaker()() as session, session.begin():
        task = session.get(Task, target.task_id)
        call = session.scalar(
            select(ToolCall).where(
                ToolCall.task_id == target.task_id, ToolCall.call_id == target.call_id
            )
        )
        if task is not None:
            session.expunge(task)
        if call is not None:
            session.expunge(call)
    if task is None or call is None:
        raise NotFound("this approval link's call no longer exists")
    return {"task": task, "call": call}


def _refused(request: Request, exc: LinkRefused) -> Response:
    status = 410 if exc.expired else 403
    return page(request, "link.html", None, status=status, error=str(exc), call=None, token="")


@router.get("/approve/{token}", response_class=HTMLResponse)
async def show(request: Request, token: str) -> Response:
    try:
        target = verify(token)
        data = await run_in_threadpool(_read, target)
    except LinkRefused as exc:
        return _refused(request, exc)
    except NotFound as exc:
        return page(request, "link.html", None, status=404, error=str(exc), call=None, token="")
    return page(request, "link.html", None, error=None, token=token, done=None, **data)


def _decide(target: LinkTarget, decision: str, reason: str | None) -> None:
    with get_sessionmaker()() as session:
        decided, effects = approvals.decide(
            session,
            target.task_id,
            target.call_id,
            decision=decision,
            decided_by="link",
            tenant_id=None,
            reason=reason,
        )
    if decided.replayed:
        raise Conflict(f"this call was already decided: {decided.call.decision}")
    after_commit(effects)


@router.post("/approve/{token}", response_class=HTMLResponse)
async def use(
    request: Request,
    token: str,
    decision: Annotated[str, Form(pattern="^(approve|reject)$")],
    reason: Annotated[str | None, Form(max_length=2000)] = None,
) -> Response:
    same_origin(request)
    try:
        target = verify(token)
        await run_in_threadpool(_decide, target, decision, (reason or "").strip() or None)
        data = await run_in_threadpool(_read, target)
    except LinkRefused as exc:
        return _refused(request, exc)
    except (Conflict, NotFound) as exc:
        data = await run_in_threadpool(_read, target)
        return page(request, "link.html", None, status=409, error=str(exc), token="", **data)
    return page(request, "link.html", None, error=None, token="", done=decision, **data)
