"""``GET /v1/threads/{id}/events``: every turn's events, in order, as one SSE stream.

A chat UI subscribes once. Each event's id is ``<turn>:<seq>``: the turn's number in the
thread and the event's seq in that turn's log (``GET /v1/tasks/{id}/events``), so ids order
events across turns, and ``Last-Event-ID`` resumes after any of them. The stream reads one
turn's log at a time: it moves to the next turn once the current one's log ends in a
terminal event and a next turn exists, and it never ends on its own (a comment line keeps it
alive while the thread is idle). A turn rolled back is streamed as it happened: its events
stay in its log.

While a turn's model call streams, its deltas come between its committed events as they do
on the turn's own stream (``message.delta``, ``message.discarded``; ``shared.deltas``), with
ids ``<turn>:<seq>.<pos>``: ``Last-Event-ID`` resumes mid-call there too.

A turn's committed events come from one reader (:func:`read_turn`), its deltas from the
transport. Wake-ups come from the event hub, for the current turn's task (its events and its
deltas) and for the thread (a new turn wakes it); Postgres holds the events themselves, so a
resumed stream sends every event exactly once, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy import select

from api.event_hub import LiveWatch, hub
from api.params import parse_seq
from api.problems import DATABASE_RETRY_AFTER_SECONDS, DATABASE_UNAVAILABLE, responses
from api.stream_limits import StreamReader
from shared.deltas import Cursor, Delta, aread_live, event_id, parse_event_id
from shared.errors import InvalidRequest, NotFound
from shared.store import threads
from shared.store.db import get_sessionmaker
from shared.store.events import TERMINAL_EVENT_TYPES, last_event, list_events
from shared.store.tables import Task
from shared.store.tenants import APPROVE

router = APIRouter(prefix="/v1/threads", tags=["events"])
KEEPALIVE_SECONDS = 15.0
FALLBACK_POLL_SECONDS = 2.0
BATCH = 500


@dataclass(frozen=True)
class Position:
    """Where the stream is: after event ``seq`` of turn ``turn`` (seq 0: before its first),
    and, mid-call, after the delta ``pos`` of that turn's delta log."""

    turn: int
    seq: int
    pos: int = 0

    @property
    def id(self) -> str:
        return f"{self.turn}:{event_id(self.seq, self.pos) if self.pos else self.seq}"


def parse_position(event_id: str | None, *, field: str = "Last-Event-ID") -> Position:
    """``<turn>:<seq>`` or ``<turn>:<seq>.<pos>`` as this stream sends them; none: from the
    thread's first turn."""
    if event_id is None or not event_id.strip():
        return Position(1, 0)
    turn, colon, seq = event_id.strip().partition(":")
    if not colon:
        raise InvalidRequest(field, "must be <turn>:<seq>, an id this stream sent")
    try:
        at, pos = parse_event_id(seq)
    except ValueError:
        raise InvalidRequest(field, "must be <turn>:<seq>, an id this stream sent") from None
    return Position(parse_seq(turn, field=field) or 1, at, pos)


@dataclass(frozen=True)
class TurnRead:
    """A read of one turn: its task (None: no such turn yet), the events after the position
    (seq, type, JSON data), whether its log ends there, and whether a later turn exists."""

    task_id: str | None
    events: list[tuple[int, str, str]]
    ended_at: int | None
    later: bool


def read_turn(tenant_id: str, thread_id: str, at: Position, *, approval_links: bool) -> TurnRead:
    """The turn at ``at``: its events after ``at.seq``; the thread must be the tenant's."""
    with get_sessionmaker()() as session, session.begin():
        threads.get_thread(session, tenant_id, thread_id)
        rows = session.execute(
            select(Task.id, Task.turn)
            .where(Task.thread_id == thread_id, Task.turn >= at.turn)
            .order_by(Task.turn)
            .limit(2)
        ).all()
        current = next((row.id for row in rows if row.turn == at.turn), None)
        later = any(row.turn > at.turn for row in rows)
        if current is None:
            return TurnRead(None, [], None, later)
        events = [
            (e.seq, e.type, json.dumps(e.data, separators=(",", ":")))
            for e in list_events(
                session, current, after=at.seq, limit=BATCH, approval_links=approval_links
            )
        ]
        newest = last_event(session, current)
        ended = newest.seq if newest is not None and newest.type in TERMINAL_EVENT_TYPES else None
        return TurnRead(current, events, ended, later)


async def _stream(
    request: Request, tenant_id: str, thread_id: str, start: Position, *, approval_links: bool
) -> AsyncIterator[str]:
    turn, cursor = start.turn, Cursor.resuming(start.seq, start.pos)
    quiet_since = time.monotonic()
    async with hub.watch(thread_id) as new_turn, contextlib.AsyncExitStack() as watching:
        watched: str | None = None
        woken = LiveWatch()  # the current turn's wake-ups, once its task is watched
        read = TurnRead(None, [], None, later=False)
        look = True  # read the turn's log: something was committed there (or may have been)
        while not hub.closing:
            new_turn.clear()
            woken.changed.clear()
            events: list[tuple[int, str, str]] = []
            if look or woken.committed:
                look = woken.committed = False
                read = await run_in_threadpool(
                    read_turn,
                    tenant_id,
                    thread_id,
                    Position(turn, cursor.seq),
                    approval_links=approval_links,
                )
                if read.task_id is not None and read.task_id != watched:
                    # Watch the turn's task from now on, then read again: no wake-up between
                    # the read and the watch is missed.
                    await watching.aclose()
                    woken = await watching.enter_async_context(hub.watch_live(read.task_id))
                    watched, look = read.task_id, True
                    continue
                events = read.events
            # Read after the log: a call's deltas are all in before its answer is committed.
            live: list[Delta] = []
            full = False
            if watched is not None:
                live, full = await aread_live(watched, cursor)
            chunks, live = _interleaved(turn, cursor, events, live)
            for chunk in chunks:
                yield chunk
                quiet_since = time.monotonic()
            if live:
                look = True  # deltas after a commit this stream has not read
            if len(events) == BATCH or (live and events) or full:
                continue  # more events waiting, the commit those deltas follow, or more deltas
            ended = read.task_id is None or (
                read.ended_at is not None and cursor.seq >= read.ended_at
            )
            if read.later and ended:  # on to the next turn: this one's log ended (or is none)
                turn, cursor, look = turn + 1, Cursor(0), True
                continue
            if await request.is_disconnected():
                return
            if not await _wait(woken.changed, new_turn) or new_turn.is_set():
                look = True  # a new turn, or a wake-up may have been lost: look at the log
            if time.monotonic() - quiet_since >= KEEPALIVE_SECONDS:
                yield ": keep-alive\n\n"
                quiet_since = time.monotonic()
    yield _error_event("shutting-down", "the server is stopping; reconnect with Last-Event-ID")


def _interleaved(
    turn: int, cursor: Cursor, events: list[tuple[int, str, str]], live: list[Delta]
) -> tuple[list[str], list[Delta]]:
    """The turn's committed ``events``, each after the last deltas of the call it answers
    (for a reader that holds part of it), then the deltas of the call in progress; and the
    deltas that follow a commit not read yet. Moves the cursor."""
    chunks: list[str] = []
    for seq, type_, data in events:
        send, live = cursor.before_commit(live)
        chunks += [_delta_event(turn, delta) for delta in send]
        chunks.append(f"id: {turn}:{seq}\nevent: {type_}\ndata: {data}\n\n")
        cursor.committed(seq)
    send, live = cursor.take(live)
    return chunks + [_delta_event(turn, delta) for delta in send], live


def _delta_event(turn: int, delta: Delta) -> str:
    return f"id: {turn}:{delta.event_id}\nevent: {delta.event_type}\ndata: {delta.data}\n\n"


async def _wait(changed: asyncio.Event, new_turn: asyncio.Event) -> bool:
    """Until the current turn has new events or deltas, or the thread a new turn; whether one
    came (False: the fallback poll's time passed)."""
    waits = [asyncio.ensure_future(changed.wait()), asyncio.ensure_future(new_turn.wait())]
    try:
        done, _ = await asyncio.wait(
            waits, timeout=FALLBACK_POLL_SECONDS, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        for waiting in waits:
            waiting.cancel()
    return bool(done)


def _error_event(slug: str, detail: str) -> str:
    problem = {"type": f"urn:ratchet:problem:{slug}", "title": "Service Unavailable"}
    data = json.dumps({**problem, "status": 503, "detail": detail}, separators=(",", ":"))
    return f"retry: {DATABASE_RETRY_AFTER_SECONDS * 1000}\nevent: error\ndata: {data}\n\n"


async def _ending_cleanly(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """``stream``, ended by an ``error`` event if the database becomes unavailable, and ended
    (its response complete) if the thread is deleted while it streams."""
    try:
        async for chunk in stream:
            yield chunk
    except NotFound:
        return
    except DATABASE_UNAVAILABLE:
        detail = "the database is unavailable; reconnect with Last-Event-ID shortly"
        yield _error_event("database-unavailable", detail)


def _first_turn(tenant_id: str, thread_id: str) -> int:
    """The thread's first own turn (a fork's turns before it are its source's, streamed
    there); NotFound for another tenant's thread."""
    with get_sessionmaker()() as session, session.begin():
        return (threads.get_thread(session, tenant_id, thread_id).fork_turn or 0) + 1


@router.get(
    "/{thread_id}/events",
    response_class=StreamingResponse,
    summary="Stream every turn's events (SSE)",
    responses={
        200: {
            "description": "The thread's event stream: replayed, then live, turn after turn; "
            "it does not end when a turn ends",
            "content": {
                "text/event-stream": {
                    "example": 'id: 2:1\nevent: task.queued\ndata: {"id": "…", "turn": 2}\n\n'
                }
            },
        },
        **responses(
            {
                404: "no such thread (another tenant's thread is not found either)",
                422: "``Last-Event-ID`` is not an id this stream sent (``<turn>:<seq>``, or "
                "``<turn>:<seq>.<pos>`` for a delta)",
                429: "the tenant holds its most streams and long polls",
                503: "the database is unavailable, or the server holds its most streams",
            }
        ),
    },
)
async def stream_thread_events(
    thread_id: str,
    principal: StreamReader,
    request: Request,
    after: Annotated[
        str | None,
        Query(max_length=50, description="replay events after this id (``<turn>:<seq>``)"),
    ] = None,
    last_event_id: Annotated[
        str | None,
        Header(max_length=50, description="resume after this id (``?after=`` wins over it)"),
    ] = None,
) -> StreamingResponse:
    """Server-sent events of every turn, each ``id: <turn>:<seq>``, ``event: <type>``,
    ``data: <json>`` (as the turn's own stream sends them), and while a model call streams its
    ``message.delta`` events, ids ``<turn>:<seq>.<pos>``. Needs the ``tasks:read`` scope."""
    if after is not None:
        start = parse_position(after, field="after")
    else:
        start = parse_position(last_event_id)
    first = await run_in_threadpool(_first_turn, principal.tenant_id, thread_id)
    if start.turn < first:
        start = Position(first, 0)
    return StreamingResponse(
        _ending_cleanly(
            _stream(
                request,
                principal.tenant_id,
                thread_id,
                start,
                approval_links=principal.allows(APPROVE),
            )
        ),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
