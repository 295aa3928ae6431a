"""``/v1/tasks``: submit, read, list, cancel, retry, and the step timeline."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError

from api import submission
from api.deps import Reader, SessionDep, Writer
from api.event_hub import hub
from api.schemas import StepList, StepOut, TaskCreate, TaskList, ToolCallOut
from shared import checkpoints, ledger, metrics, notify, task_store
from shared.db import get_sessionmaker
from shared.errors import Conflict, IdempotencyMismatch, InvalidRequest
from shared.models import Step, Task, TaskStatus, ToolCall
from shared.queue import enqueue_deliveries, enqueue_step
from shared.settings import get_settings
from shared.views import TaskView, Usage, aware, task_view

log = logging.getLogger("ratchet.api")
router = APIRouter(prefix="/v1/tasks", tags=["tasks"])
MAX_WAIT_SECONDS = 60
FALLBACK_POLL_SECONDS = 2.0


def _after_commit(task: Task, deliveries: list[str], *, run: bool = False) -> None:
    """The change is committed: wake readers, send webhooks, and (``run``) ask a worker to
    advance the task. If the broker is down the sweeper sends these messages later."""
    notify.publish([task.id])
    try:
        if deliveries:
            enqueue_deliveries(deliveries)
        if run:
            enqueue_step(task.id, task.steps + 1)
    except Exception:
        log.exception("enqueue failed; the sweeper will retry", extra={"task_id": task.id})


def _replay(existing: Task, digest: str) -> Task:
    if existing.request_hash != digest:
        raise IdempotencyMismatch
    return existing


async def submitted_task(request: Request, _: Writer) -> TaskCreate:
    """The request body as a TaskCreate, parsed only once the caller may submit."""
    raw = await request.body()
    document: Any = None
    try:
        document = json.loads(raw) if raw else None
        return TaskCreate.model_validate_json(raw or b"null")
    except ValueError as exc:
        errors: list[Any] = []
        if isinstance(exc, ValidationError):
            errors = list(exc.errors(include_url=False))
        if document is None and raw:
            errors = [{"type": "json_invalid", "loc": (), "msg": "the body is not valid JSON"}]
        elif document is None:
            errors = [{"type": "missing", "loc": (), "msg": "a JSON request body is required"}]
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in errors], body=document
        ) from None


TASK_CREATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TaskCreate"}}},
    }
}


@router.post("", status_code=202, response_model=TaskView, openapi_extra=TASK_CREATE_BODY)
def submit_task(
    body: Annotated[TaskCreate, Depends(submitted_task)],
    principal: Writer,
    session: SessionDep,
    response: Response,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> TaskView:
    """Submit a task. Returns at once with the queued task; a worker runs it."""
    spec = submission.resolve(body, get_settings())
    submission.check_rate(principal.tenant_name)
    digest = submission.request_hash(body)
    created = False
    deliveries: list[str] = []
    try:
        with session.begin():
            existing = idempotency_key and task_store.find_by_idempotency_key(
                session, principal.tenant_id, idempotency_key
            )
            if existing:
                task = _replay(existing, digest)
            else:
                task = task_store.create_task(
                    session,
                    principal.tenant_id,
                    spec,
                    idempotency_key=idempotency_key,
                    request_hash=digest,
                    deliveries=deliveries,
                )
                created = True
    except IntegrityError:
        # A concurrent request with the same key committed first.
        assert idempotency_key is not None
        with session.begin():
            existing = task_store.find_by_idempotency_key(
                session, principal.tenant_id, idempotency_key
            )
        if existing is None:
            raise Conflict("a request with this Idempotency-Key is in progress") from None
        task, created = _replay(existing, digest), False
    if created:
        metrics.tasks_submitted.inc()
        _after_commit(task, deliveries, run=True)
    else:
        response.headers["Idempotent-Replayed"] = "true"
    response.headers["Location"] = f"/v1/tasks/{task.id}"
    return task_view(task)


def _read_task(tenant_id: str, task_id: str) -> Task:
    with get_sessionmaker()() as session, session.begin():
        return task_store.get_task(session, tenant_id, task_id)


@router.get("/{task_id}", response_model=TaskView)
async def get_task(
    task_id: str,
    principal: Reader,
    wait: Annotated[
        float,
        Query(ge=0, le=MAX_WAIT_SECONDS, description="long-poll up to N s for a terminal state"),
    ] = 0,
) -> TaskView:
    """The task. With ``wait``, answers as soon as it is terminal, or after ``wait`` seconds."""
    deadline = time.monotonic() + wait
    async with hub.watch(task_id) as changed:
        while True:
            changed.clear()
            task = await run_in_threadpool(_read_task, principal.tenant_id, task_id)
            left = deadline - time.monotonic()
            if task.status in TaskStatus.TERMINAL or left <= 0:
                return task_view(task)
            # A wake-up says "look again"; the timeout is only the fallback if one is lost.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=min(left, FALLBACK_POLL_SECONDS))


@router.get("", response_model=TaskList)
def list_tasks(
    principal: Reader,
    session: SessionDep,
    status: Annotated[str | None, Query(description="filter by status")] = None,
    agent: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
) -> TaskList:
    if status is not None and status not in TaskStatus.ALL:
        raise InvalidRequest("status", f"must be one of {', '.join(TaskStatus.ALL)}")
    after = _decode_task_cursor(cursor)
    with session.begin():
        rows, last = task_store.list_tasks(
            session, principal.tenant_id, status=status, agent=agent, limit=limit, after_id=after
        )
        items = [task_view(t) for t in rows]
    return TaskList(items=items, next_cursor=task_store.encode_cursor(last) if last else None)


def _decode(cursor: str | None) -> str | None:
    if cursor is None:
        return None
    try:
        return task_store.decode_cursor(cursor)
    except ValueError:
        raise InvalidRequest("cursor", "not a cursor this API returned") from None


def _decode_task_cursor(cursor: str | None) -> str | None:
    after = _decode(cursor)
    if after is not None:
        try:
            uuid.UUID(after)
        except ValueError:
            raise InvalidRequest("cursor", "not a cursor this API returned") from None
    return after


@router.post("/{task_id}/cancel", status_code=202, response_model=TaskView)
def cancel_task(task_id: str, principal: Writer, session: SessionDep) -> TaskView:
    """Cancel now if no worker holds the task, else at its next commit point. 409 if terminal."""
    deliveries: list[str] = []
    with session.begin():
        task = task_store.request_cancel(
            session, principal.tenant_id, task_id, deliveries=deliveries
        )
    _after_commit(task, deliveries)
    return task_view(task)


@router.post("/{task_id}/retry", status_code=202, response_model=TaskView)
def retry_task(task_id: str, principal: Writer, session: SessionDep) -> TaskView:
    """A failed task resumes from its last committed step. 409 unless failed."""
    deliveries: list[str] = []
    with session.begin():
        task = task_store.requeue_failed(
            session, principal.tenant_id, task_id, deliveries=deliveries
        )
    _after_commit(task, deliveries, run=True)
    return task_view(task)


@router.get("/{task_id}/steps", response_model=StepList)
def list_steps(
    task_id: str,
    principal: Reader,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 100,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
) -> StepList:
    """The step timeline: each model call and the tool calls it asked for."""
    after = _decode(cursor)
    if after is not None and not after.isdigit():
        raise InvalidRequest("cursor", "not a cursor this API returned")
    with session.begin():
        task = task_store.get_task(session, principal.tenant_id, task_id)
        steps = checkpoints.load_steps(session, task_id, after=int(after or 0), limit=limit + 1)
        more = len(steps) > limit
        steps = steps[:limit]
        calls = ledger.calls_for_task(session, task_id, steps=[s.number for s in steps])
        items = [_step_out(s, [c for c in calls if c.step_number == s.number]) for s in steps]
    next_cursor = task_store.encode_cursor(str(steps[-1].number)) if more else None
    return StepList(items=items, next_cursor=next_cursor, waiting=task.waiting)


def _step_out(step: Step, calls: list[ToolCall]) -> StepOut:
    return StepOut(
        number=step.number,
        status=step.status,
        model=step.response,
        usage=Usage(
            input_tokens=step.input_tokens, output_tokens=step.output_tokens, cost_usd=step.cost_usd
        ),
        model_latency_ms=step.model_latency_ms,
        started_at=aware(step.started_at),
        model_completed_at=aware(step.model_completed_at),
        completed_at=aware(step.completed_at),
        tool_calls=[
            ToolCallOut(
                id=c.call_id,
                provider_call_id=c.provider_call_id,
                name=c.tool,
                arguments=c.arguments,
                status=c.status,
                result=c.result,
                error=c.error,
                idempotency_key=c.idempotency_key,
                runs=c.runs,
                started_at=aware(c.started_at),
                finished_at=aware(c.finished_at),
            )
            for c in calls
        ],
    )
