"""``GET /v1/tasks/{id}/events``: the task's event log as a server-sent event stream (its
machinery, shared with the dashboard's task page, is ``api.task_events``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from api.params import event_position
from api.problems import responses
from api.stream_limits import StreamReader
from api.task_events import check_exists, stream
from shared.deltas import LIVE_EVENT_TYPES, Cursor
from shared.store.events import EVENT_TYPES
from shared.store.tenants import APPROVE

router = APIRouter(prefix="/v1/tasks", tags=["events"])


# One event of the stream (OpenAPI 3.1: a sequential media type's schema describes an item).
SSE_EVENT = {
    "type": "object",
    "properties": {
        "id": {
            "type": "string",
            "pattern": "^[0-9]+(\\.[0-9]+)?$",
            "description": "a committed event's seq, or a live delta's ``<seq>.<pos>`` (after "
            "event ``seq``, before the next): resume after either with Last-Event-ID (none on "
            "an ``error`` event)",
        },
        "event": {"type": "string", "enum": [*EVENT_TYPES, *LIVE_EVENT_TYPES, "error"]},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "description": "JSON: the task for task.* events, the step's record for step.*; "
            "for ``message.delta`` (not in the durable log: sent while a model call streams, "
            "before its ``step.model_response``, which they concatenate to) ``step``, ``index`` "
            "(the delta's place in its call, from 1), ``text`` (more of the answer) and/or "
            "``tool_calls`` (each ``index``, the call's ``id`` and ``name`` on its first piece, "
            "and more of its JSON ``arguments``); for ``message.discarded`` ``step`` and "
            "``reason`` (``retried`` or ``rerun``): drop the step's partial answer, new deltas "
            "follow; and for ``error`` (the stream's last event when the database is unavailable "
            "or the server is stopping: reconnect with Last-Event-ID) a Problem",
        },
        "retry": {
            "type": "string",
            "pattern": "^[0-9]+$",
            "description": "on an ``error`` event: milliseconds to wait before reconnecting",
        },
    },
    "required": ["event", "data"],
}
STREAM_RESPONSES = {
    200: {
        "description": "The event stream: replayed, then live; it ends after the terminal "
        "event that is the task's current state",
        "content": {
            "text/event-stream": {
                "schema": SSE_EVENT,
                "example": 'id: 1\nevent: task.queued\ndata: {"id": "…", "status": "queued"}\n\n',
            }
        },
    },
    **responses(
        {
            404: "no such task (another tenant's task is not found either)",
            422: "``after`` or ``Last-Event-ID`` is not a sequence number",
            429: "the tenant holds its most streams and long polls",
            503: "the database is unavailable, or the server holds its most streams and long polls",
        }
    ),
}


@router.get(
    "/{task_id}/events",
    response_class=StreamingResponse,
    summary="Stream a task's events (SSE)",
    responses=STREAM_RESPONSES,
)
async def stream_events(
    task_id: str,
    principal: StreamReader,
    request: Request,
    after: Annotated[int | None, Query(ge=0, description="replay events after this seq")] = None,
    last_event_id: Annotated[
        str | None,
        Header(
            max_length=40,
            description="resume after this event id: a seq, or a delta's ``<seq>.<pos>`` "
            "(``?after=`` wins over it)",
        ),
    ] = None,
) -> StreamingResponse:
    """Server-sent events, each ``id: <seq>``, ``event: <type>``, ``data: <json>``, and while a
    model call streams its ``message.delta`` events (``id: <seq>.<pos>``); a comment line keeps
    an idle stream alive. Needs the ``tasks:read`` scope; a waiting call's
    ``approval_url`` is sent only to a key that may decide it (``tasks:approve``)."""
    seq, pos = event_position(after, last_event_id)
    await run_in_threadpool(check_exists, principal.tenant_id, task_id)  # 404 before streaming
    return StreamingResponse(
        stream(
            request,
            principal.tenant_id,
            task_id,
            Cursor.resuming(seq, pos),
            approval_links=principal.allows(APPROVE),
        ),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
