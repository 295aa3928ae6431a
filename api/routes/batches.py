"""``/v1/tasks/batch`` and ``/v1/batches``: submit many tasks in one request, and follow them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from api import batch_submission, idempotency, submission
from api.deps import Reader, Writer, with_connection
from api.event_hub import hub
from api.problems import Problem, responses, title
from api.schemas.batches import BatchCreate, BatchItem, BatchSubmitted, BatchView
from api.stream_limits import limits
from shared.actions.batches import Submitted
from shared.actions.effects import after_commit
from shared.observability import metrics
from shared.statuses import TERMINAL_STATUSES
from shared.store import batches
from shared.store.db import get_sessionmaker
from shared.store.tables import Batch
from shared.store.tenants import Principal
from shared.views import aware

router = APIRouter(tags=["tasks"])
MAX_WAIT_SECONDS = 60
FALLBACK_POLL_SECONDS = 2.0
# A batch's tasks wake its long poll on every event of every one of them: it reads the batch
# again at most this often, not once per event.
READ_INTERVAL_SECONDS = 0.2


async def submitted_batch(request: Request, _: Writer) -> BatchCreate:
    """The request body as a BatchCreate, parsed only once the caller may submit."""
    return submission.parse(await request.body(), BatchCreate)


BATCH_CREATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/BatchCreate"}}},
    }
}
BATCH_RESPONSES = responses({404: "no such batch (another tenant's batch is not found either)"})


@router.post(
    "/v1/tasks/batch",
    status_code=202,
    response_model=BatchSubmitted,
    openapi_extra=BATCH_CREATE_BODY,
    summary="Submit a batch of tasks",
    responses={
        **idempotency.accepted(
            "Accepted: the batch's tasks are queued, and each refused item says why (or, for a "
            "repeated Idempotency-Key, the original batch)",
            location="the batch's URL",
        ),
        **responses(
            {
                409: "a request with the same Idempotency-Key (or with one of its items' keys) "
                "is still in progress",
                422: "the body is no list of 1 to RATCHET_BATCH_MAX_TASKS objects, or it "
                "reuses an Idempotency-Key with a different body; nothing was created",
                429: "the tenant is over its submission rate limit, or the batch would take it "
                "past its most queued tasks (``max_queued``); nothing was created",
                503: "the database or the rate limiter is unavailable; retry shortly",
            }
        ),
    },
)
async def submit_batch(
    request: Request,
    body: Annotated[BatchCreate, Depends(submitted_batch)],
    principal: Writer,
    response: Response,
    idempotency_key: Annotated[str | None, idempotency.key_header("the original batch")] = None,
) -> BatchSubmitted:
    """Submits every valid item as a queued task, in one transaction; an item that is not a
    valid submission (a bad field, an unknown agent, a reused ``idempotency_key``) is refused
    in its own answer and the others go ahead. Over the tenant's ``max_queued`` the whole
    batch is refused. Needs the ``tasks:write`` scope."""
    done = await with_connection(request, _submit, principal, body, idempotency_key)
    idempotency.answer(response, location=f"/v1/batches/{done.batch.id}", replayed=not done.created)
    return _submitted(done)


def _submit(principal: Principal, body: BatchCreate, key: str | None) -> Submitted:
    """The whole batch, its messages sent once it commits: one trip to the thread pool."""
    done = batch_submission.submit(principal.tenant_id, principal.tenant_name, body, key)
    if done.created:
        metrics.tasks_submitted.inc(done.batch.task_count)
        after_commit(done.effects)
    return done


def _submitted(done: Submitted) -> BatchSubmitted:
    batch = done.batch
    created_at = aware(batch.created_at)
    assert created_at is not None
    return BatchSubmitted(
        batch_id=batch.id,
        created_at=created_at,
        task_count=batch.task_count,
        refused_count=batch.refused_count,
        items=[_item(index, item, done.statuses) for index, item in enumerate(batch.items)],
    )


def _item(index: int, item: dict[str, Any], statuses: dict[str, str]) -> BatchItem:
    if "error" in item:
        return BatchItem(index=index, error=_problem(item["error"]))
    task_id = item["task_id"]
    return BatchItem(
        index=index,
        task_id=task_id,
        status=statuses.get(task_id),
        replayed=bool(item.get("replayed")),
    )


def _problem(error: dict[str, Any]) -> Problem:
    """An item's stored error as the problem it answers: always a 422, as a single submission
    of the same body would be answered."""
    return Problem(
        type=f"urn:ratchet:problem:{error['type']}",
        title=title(422),
        status=422,
        detail=error["detail"],
        errors=error.get("errors"),
    )


@dataclass(frozen=True)
class Progress:
    batch: Batch
    tasks: Sequence[tuple[str, str]]  # (id, status) of each of its tasks

    @property
    def unfinished(self) -> list[str]:
        return [task_id for task_id, status in self.tasks if status not in TERMINAL_STATUSES]


def _read(tenant_id: str, batch_id: str) -> Progress:
    with get_sessionmaker()() as session, session.begin():
        batch = batches.get_batch(session, tenant_id, batch_id)
        return Progress(batch, batches.task_statuses(session, batch.id))


@router.get(
    "/v1/batches/{batch_id}",
    response_model=BatchView,
    summary="Read a batch's tasks by status, or long-poll until all have ended",
    responses=responses(
        {
            404: "no such batch (another tenant's batch is not found either)",
            429: "with ``wait``: the tenant holds its most streams and long polls",
            503: "the database is unavailable, or with ``wait``: the server holds its most "
            "streams and long polls",
        }
    ),
)
async def get_batch(
    batch_id: str,
    principal: Reader,
    wait: Annotated[
        float,
        Query(
            ge=0,
            le=MAX_WAIT_SECONDS,
            description="long-poll up to N s for every task of the batch to be terminal",
        ),
    ] = 0,
) -> BatchView:
    """The batch's tasks by status. With ``wait``, answers as soon as every one of them is
    terminal (``completed``), or after ``wait`` seconds.

    A long poll waits on the event loop (no thread, no database connection between reads)
    and takes one of the tenant's stream slots while it waits (a 429 when it holds them all)."""
    if wait <= 0:
        return _view(await run_in_threadpool(_read, principal.tenant_id, batch_id))
    deadline = time.monotonic() + wait
    with limits.hold(principal.tenant_id):
        return _view(await _long_poll(principal.tenant_id, batch_id, deadline=deadline))


async def _long_poll(tenant_id: str, batch_id: str, *, deadline: float) -> Progress:
    progress = await run_in_threadpool(_read, tenant_id, batch_id)
    while progress.unfinished and not hub.closing:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        async with hub.watch_many(progress.unfinished) as changed:
            # Watching before reading again: a task that ends after this read wakes the wait.
            read_at = time.monotonic()
            progress = await run_in_threadpool(_read, tenant_id, batch_id)
            if not progress.unfinished:
                break
            # A wake-up says "look again"; the timeout is only the fallback if one is lost.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    changed.wait(), timeout=min(deadline - time.monotonic(), FALLBACK_POLL_SECONDS)
                )
            pause = READ_INTERVAL_SECONDS - (time.monotonic() - read_at)
            if pause > 0 and not hub.closing:
                await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
    return progress


def _view(progress: Progress) -> BatchView:
    batch = progress.batch
    by_status: dict[str, list[str]] = defaultdict(list)
    for task_id, status in progress.tasks:
        by_status[status].append(task_id)
    created_at = aware(batch.created_at)
    assert created_at is not None
    return BatchView(
        id=batch.id,
        created_at=created_at,
        task_count=batch.task_count,
        refused_count=batch.refused_count,
        completed=not progress.unfinished,
        counts={status: len(ids) for status, ids in by_status.items()},
        tasks=dict(by_status),
    )
