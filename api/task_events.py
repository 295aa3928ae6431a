"""A task's event log as server-sent events, for ``GET /v1/tasks/{id}/events`` and the
dashboard's task page (each a front door that checks its reader, then streams with this).

It replays from ``Last-Event-ID`` (or ``?after=``), then streams live; wake-ups come from the
event hub and Postgres is read for the events themselves, so a resumed stream yields every
event exactly once and in order. It ends after the terminal event that is the task's current
state: a ``task.failed`` followed by a retry's ``task.queued`` is not the end.

While a model call streams, its deltas come between the committed events as ``message.delta``
events (and ``message.discarded`` when a re-run drops a partial answer), read from the
transport, never the database; their ids, ``<seq>.<pos>``, order them with the committed
events, so ``Last-Event-ID`` resumes mid-call (``shared.deltas``). A stream that cannot read
them (Redis is down) goes on with the committed events alone.

It also ends, cleanly, when it cannot go on: the database became unavailable, or the API
process is stopping. Its last event is then an ``error`` event (no ``id``: it is not in the
log) whose data is a problem document, with a ``retry:`` hint; the client reconnects with
``Last-Event-ID`` and misses nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from api.event_hub import hub
from api.problems import DATABASE_RETRY_AFTER_SECONDS, DATABASE_UNAVAILABLE
from shared.deltas import Cursor, Delta, aread_live
from shared.store import tasks
from shared.store.db import get_sessionmaker
from shared.store.events import TERMINAL_EVENT_TYPES, last_event, list_events

log = logging.getLogger("ratchet.api.events")

KEEPALIVE_SECONDS = 15.0
FALLBACK_POLL_SECONDS = 2.0
BATCH = 500
Batch = tuple[list[tuple[int, str, str]], int | None]


def _read(tenant_id: str, task_id: str, after: int, *, approval_links: bool) -> Batch:
    """Events after ``after`` (seq, type, JSON data), and the seq of the terminal event that
    ends the log (None while the log does not end in one). Approval links only for a reader
    who may decide (``approval_links``).

    The last event is read after the batch: the log only grows, so when the newest event is
    terminal and the stream has sent it, nothing follows it (a retry appends after it)."""
    with get_sessionmaker()() as session, session.begin():
        tasks.get_task(session, tenant_id, task_id)
        events = [
            (e.seq, e.type, json.dumps(e.data, separators=(",", ":")))
            for e in list_events(
                session, task_id, after=after, limit=BATCH, approval_links=approval_links
            )
        ]
        newest = last_event(session, task_id)
        end = newest.seq if newest is not None and newest.type in TERMINAL_EVENT_TYPES else None
        return events, end


def check_exists(tenant_id: str, task_id: str) -> None:
    """NotFound unless the task is ``tenant_id``'s."""
    with get_sessionmaker()() as session, session.begin():
        tasks.get_task(session, tenant_id, task_id)


async def _stream(
    request: Request, tenant_id: str, task_id: str, cursor: Cursor, *, approval_links: bool
) -> AsyncIterator[str]:
    quiet_since = time.monotonic()
    async with hub.watch_live(task_id) as woken:
        while not hub.closing:
            woken.changed.clear()
            events: list[tuple[int, str, str]] = []
            end = None
            if woken.committed:
                woken.committed = False
                events, end = await run_in_threadpool(
                    _read, tenant_id, task_id, cursor.seq, approval_links=approval_links
                )
            # Read after the log: a call's deltas are all in before its answer is committed,
            # and those of the call in progress go before the events that follow it.
            live, full = await aread_live(task_id, cursor)
            for seq, type_, data in events:
                send, live = cursor.before_commit(live)
                for delta in send:
                    yield _delta_event(delta)
                yield f"id: {seq}\nevent: {type_}\ndata: {data}\n\n"
                cursor.committed(seq)
                quiet_since = time.monotonic()
            if end is not None and cursor.seq >= end:
                return  # sent (now or before this stream resumed) the terminal event
            send, live = cursor.take(live)
            for delta in send:
                yield _delta_event(delta)
                quiet_since = time.monotonic()
            if live:
                woken.committed = True  # deltas after a commit this stream has not read
            if len(events) == BATCH or (live and events):
                continue  # more events waiting, or the commit those deltas follow
            if full:
                continue  # more deltas waiting
            if await request.is_disconnected():
                return
            try:
                await asyncio.wait_for(woken.changed.wait(), timeout=FALLBACK_POLL_SECONDS)
            except TimeoutError:
                woken.committed = True  # a wake-up may have been lost: look at the log
            if time.monotonic() - quiet_since >= KEEPALIVE_SECONDS:
                yield ": keep-alive\n\n"
                quiet_since = time.monotonic()
    yield _error_event("shutting-down", "the server is stopping; reconnect with Last-Event-ID")


def _delta_event(delta: Delta) -> str:
    return f"id: {delta.event_id}\nevent: {delta.event_type}\ndata: {delta.data}\n\n"


def _error_event(slug: str, detail: str) -> str:
    """The last event of a stream that cannot go on: a problem, and when to reconnect."""
    problem = {"type": f"urn:ratchet:problem:{slug}", "title": "Service Unavailable"}
    data = json.dumps({**problem, "status": 503, "detail": detail}, separators=(",", ":"))
    return f"retry: {DATABASE_RETRY_AFTER_SECONDS * 1000}\nevent: error\ndata: {data}\n\n"


async def _ending_cleanly(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """``stream``, ended by an ``error`` event if the database becomes unavailable: the
    response then ends as a whole (its last chunk sent), not cut off mid-stream."""
    try:
        async for chunk in stream:
            yield chunk
    except DATABASE_UNAVAILABLE as exc:
        cause = getattr(exc, "orig", None) or exc
        log.warning("an event stream ended: the database is unavailable (%s)", type(cause).__name__)
        detail = "the database is unavailable; reconnect with Last-Event-ID shortly"
        yield _error_event("database-unavailable", detail)


def stream(
    request: Request, tenant_id: str, task_id: str, cursor: Cursor, *, approval_links: bool
) -> AsyncIterator[str]:
    """The task's events after ``cursor`` as SSE lines, replayed then live, ended cleanly; the
    caller has checked the task is ``tenant_id``'s (the dashboard's stream reads it too)."""
    return _ending_cleanly(
        _stream(request, tenant_id, task_id, cursor, approval_links=approval_links)
    )
