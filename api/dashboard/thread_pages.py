"""The thread list (filters in the URL, keyset pages) and the thread page: the conversation
as a transcript, each turn linked to its task, live while a turn runs (the page follows the
running turn's task event stream, ``/dashboard/tasks/{id}/events``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, Response

from api.dashboard.auth import PATH, CurrentLogin
from api.dashboard.pages import scope_of
from api.dashboard.render import page
from shared.agents.registry import get_registry
from shared.errors import InvalidRequest, NotFound
from shared.ops import conversations
from shared.ops.conversations import ThreadFilter
from shared.ops.sessions import Login
from shared.store.db import get_sessionmaker
from shared.store.events import last_event
from shared.views import usage_of

router = APIRouter(prefix=PATH, include_in_schema=False)
PAGE = 50


def _filter(values: dict[str, str], login: Login) -> ThreadFilter:
    text = {k: (values.get(k) or "").strip() or None for k in ("tenant", "agent", "metadata")}
    return ThreadFilter(
        tenant=text["tenant"] if login.operator else None,
        agent=text["agent"],
        metadata=text["metadata"],
    )


def _list(login: Login, where: ThreadFilter, after: str | None) -> dict[str, Any]:
    with get_sessionmaker()() as session, session.begin():
        rows, next_id = conversations.list_threads(
            session, scope_of(login), where, limit=PAGE, after_id=after
        )
    return {"threads": rows, "next_id": next_id}


@router.get("/threads", response_class=HTMLResponse)
async def threads_page(
    request: Request, login: CurrentLogin, after: Annotated[str | None, Query(max_length=64)] = None
) -> Response:
    agents = sorted(get_registry().agents)
    try:
        where = _filter(dict(request.query_params), login)
    except InvalidRequest as exc:
        return page(
            request, "threads.html", login, error=str(exc), params={}, threads=[], agents=agents
        )
    found = await run_in_threadpool(_list, login, where, after)
    return page(
        request, "threads.html", login, error=None, params=where.as_params(), agents=agents, **found
    )


def _thread(login: Login, thread_id: str) -> dict[str, Any]:
    with get_sessionmaker()() as session, session.begin():
        shown = conversations.transcript(session, scope_of(login), thread_id)
        running = shown.running
        # The running turn's stream starts after the events this page already shows.
        newest = last_event(session, running.id) if running is not None else None
    usage = {t.task.id: usage_of(t.task, model=t.task.model) for t in shown.turns if t.task}
    return {
        "t": shown,
        "usage": usage,
        "follow": running.id if running is not None else None,
        "follow_after": newest.seq if newest is not None else 0,
    }


@router.get("/threads/{thread_id}", response_class=HTMLResponse)
async def thread_page(request: Request, login: CurrentLogin, thread_id: str) -> Response:
    try:
        data = await run_in_threadpool(_thread, login, thread_id)
    except NotFound as exc:
        return page(request, "error.html", login, status=404, message=str(exc))
    return page(request, "thread.html", login, **data)
