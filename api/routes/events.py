"""``GET /v1/tasks/{id}/events``: the task's event log as a server-sent event stream.

It replays from ``Last-Event-ID`` (or ``?after=``), then streams live; wake-ups come from the
event hub and Postgres is read for the events themselves, so a resumed stream yields every
event exactly once and in order. It ends after the terminal event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from api.deps import Reader
from api.event_hub import hub
from shared import task_store
from shared.db import get_sessionmaker
from shared.errors import InvalidRequest
from shared.events import TERMINAL_EVENT_TYPES, list_events
from shared.models import TaskStatus

router = APIRouter(prefix="/v1/tasks", tags=["events"])
KEEPALIVE_SECONDS = 15.0
FALLBACK_POLL_SECONDS = 2.0
Batch = tuple[list[tuple[int, str, str]], bool]


def _read(tenant_id: str, task_id: str, after: int) -> Batch:
    """Events after ``after`` (seq, type, JSON data), and whether the task is terminal."""
    with get_sessionmaker()() as session, session.begin():
        task = task_store.get_task(session, tenant_id, task_id)
        events = [
            (e.seq, e.type, json.dumps(e.data, separators=(",", ":")))
            for e in list_events(session, task_id, after=after)
        ]
        return events, task.status in TaskStatus.TERMINAL


def _check_exists(tenant_id: str, task_id: str) -> None:
    with get_sessionmaker()() as session, session.begin():
        task_store.get_task(session, tenant_id, task_id)


def _start(after: int | None, last_event_id: str | None) -> int:
    if after is not None:
        return after
    if last_event_id is None:
        return 0
    if not last_event_id.strip().isdigit():
        raise InvalidRequest("Last-Event-ID", "must be the id of an event this stream sent")
    return int(last_event_id)


async def _stream(request: Request, tenant_id: str, task_id: str, after: int) -> AsyncIterator[str]:
    last, quiet_since = after, time.monotonic()
    async with hub.watch(task_id) as changed:
        while True:
            changed.clear()
            events, terminal = await run_in_threadpool(_read, tenant_id, task_id, last)
            for seq, type_, data in events:
                yield f"id: {seq}\nevent: {type_}\ndata: {data}\n\n"
                last, quiet_since = seq, time.monotonic()
                if type_ in TERMINAL_EVENT_TYPES:
                    return
            if terminal and not events:
                return  # the terminal event was sent before this stream resumed
            if await request.is_disconnected():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=FALLBACK_POLL_SECONDS)
            if time.monotonic() - quiet_since >= KEEPALIVE_SECONDS:
                yield ": keep-alive\n\n"
                quiet_since = time.monotonic()


@router.get("/{task_id}/events", response_class=StreamingResponse)
async def stream_events(
    task_id: str,
    principal: Reader,
    request: Request,
    after: Annotated[int | None, Query(ge=0, description="replay events after this seq")] = None,
    last_event_id: Annotated[str | None, Header(max_length=20)] = None,
) -> StreamingResponse:
    """Server-sent events: ``id: <seq>``, ``event: <type>``, ``data: <json>``."""
    start = _start(after, last_event_id)
    await run_in_threadpool(_check_exists, principal.tenant_id, task_id)  # 404 before streaming
    return StreamingResponse(
        _stream(request, principal.tenant_id, task_id, start),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
