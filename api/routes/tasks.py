"""``/v1/tasks``: submit, read, list, cancel, retry, and the step timeline."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from api import idempotency, params, submission
from api.deps import Reader, SessionDep, Writer, with_connection
from api.event_hub import hub
from api.params import PageCursor, PageLimit, cursor_after, parse_seq
from api.problems import responses
from api.schemas.tasks import (
    CallApproval,
    FailedModelCall,
    StepList,
    StepOut,
    StepUsage,
    SummaryOut,
    TaskCreate,
    TaskList,
    ToolCallOut,
)
from api.stream_limits import limits
from shared.actions import tasks as task_actions
from shared.actions.effects import after_commit
from shared.actions.tasks import Submitted
from shared.errors import InvalidRequest
from shared.pricing import is_priced
from shared.statuses import TERMINAL_STATUSES, TaskStatus
from shared.store import checkpoints, families, ledger, tasks
from shared.store import waits as store_waits
from shared.store.db import get_sessionmaker
from shared.store.summaries import list_summaries
from shared.store.tables import Step, Summary, Task, ToolCall
from shared.store.tenants import APPROVE, Principal
from shared.views import TaskView, Usage, aware, task_view, usage_of

router = APIRouter(prefix="/v1/tasks", tags=["tasks"])
MAX_WAIT_SECONDS = 60
FALLBACK_POLL_SECONDS = 2.0


async def submitted_task(request: Request, _: Writer) -> TaskCreate:
    """The request body as a TaskCreate, parsed only once the caller may submit."""
    return submission.parse(await request.body())


TASK_CREATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TaskCreate"}}},
    }
}


SUBMIT_RESPONSES = {
    **idempotency.accepted(
        "Accepted: the task is queued (or, for a repeated Idempotency-Key, the original task)",
        location="the task's URL",
    ),
    **responses(
        {
            409: "a request with the same Idempotency-Key is still in progress",
            422: "the body is invalid (``errors`` names each bad field), names an unknown "
            "agent, tool or model, or reuses an Idempotency-Key with a different body",
            429: "the tenant is over its submission rate limit, or holds its most queued "
            "tasks (``max_queued``); nothing was created",
            503: "the database or the rate limiter is unavailable; retry shortly",
        }
    ),
}
TASK_RESPONSES = responses({404: "no such task (another tenant's task is not found either)"})
TERMINAL_RESPONSES = responses(
    {
        404: "no such task (another tenant's task is not found either)",
        409: "the task is in a state that does not allow this",
    }
)


@router.post(
    "",
    status_code=202,
    response_model=TaskView,
    openapi_extra=TASK_CREATE_BODY,
    summary="Submit a task",
    responses=SUBMIT_RESPONSES,
)
async def submit_task(
    request: Request,
    body: Annotated[TaskCreate, Depends(submitted_task)],
    principal: Writer,
    response: Response,
    idempotency_key: Annotated[str | None, idempotency.key_header("the original task")] = None,
) -> TaskView:
    """Returns at once with the queued task; a worker runs it. Only ``input`` is required.
    Needs the ``tasks:write`` scope."""
    done = await with_connection(request, _submit, principal, body, idempotency_key)
    idempotency.answer(response, location=f"/v1/tasks/{done.task.id}", replayed=done.replayed)
    return task_view(done.task)


def _submit(principal: Principal, body: TaskCreate, key: str | None) -> Submitted:
    """The whole submission, its messages sent once it commits: one trip to the thread pool."""
    done = submission.submit(principal.tenant_id, principal.tenant_name, body, key)
    return idempotency.after_submit(done)


def _read_task(tenant_id: str, task_id: str) -> Task:
    with get_sessionmaker()() as session, session.begin():
        return tasks.get_task(session, tenant_id, task_id)


@router.get(
    "/{task_id}",
    response_model=TaskView,
    summary="Read a task, or long-poll until it ends",
    responses=responses(
        {
            404: "no such task (another tenant's task is not found either)",
            429: "with ``wait``: the tenant holds its most streams and long polls",
            503: "the database is unavailable, or with ``wait``: the server holds its most "
            "streams and long polls",
        }
    ),
)
async def get_task(
    task_id: str,
    principal: Reader,
    wait: Annotated[
        float,
        Query(ge=0, le=MAX_WAIT_SECONDS, description="long-poll up to N s for a terminal state"),
    ] = 0,
) -> TaskView:
    """With ``wait``, answers as soon as the task is terminal, or after ``wait`` seconds.

    A long poll waits on the event loop (no thread, no database connection) and takes one of
    the tenant's stream slots while it waits (a 429 when it holds them all)."""
    deadline = time.monotonic() + wait
    links = principal.allows(APPROVE)  # a waiting call's approval_url: only for who may decide
    if wait <= 0:
        task = await run_in_threadpool(_read_task, principal.tenant_id, task_id)
        return task_view(task, approval_links=links)
    # The slot comes before any read: a tenant past its share is turned away without a
    # thread or a query, however many long polls it opens.
    with limits.hold(principal.tenant_id):
        return await _long_poll(
            principal.tenant_id, task_id, deadline=deadline, approval_links=links
        )


async def _long_poll(
    tenant_id: str, task_id: str, *, deadline: float, approval_links: bool
) -> TaskView:
    async with hub.watch(task_id) as changed:
        while True:
            changed.clear()
            task = await run_in_threadpool(_read_task, tenant_id, task_id)
            left = deadline - time.monotonic()
            # A stopping process answers at once with what it has: a long poll may end early.
            if task.status in TERMINAL_STATUSES or left <= 0 or hub.closing:
                return task_view(task, approval_links=approval_links)
            # A wake-up says "look again"; the timeout is only the fallback if one is lost.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=min(left, FALLBACK_POLL_SECONDS))


@router.get("", response_model=TaskList, summary="List tasks, newest first")
def list_tasks(
    principal: Reader,
    session: SessionDep,
    status: Annotated[
        str | None,
        Query(
            description="only tasks in this state",
            json_schema_extra={"enum": [status.value for status in TaskStatus]},
        ),
    ] = None,
    agent: Annotated[str | None, Query(max_length=200, description="only this agent's")] = None,
    limit: PageLimit = 50,
    cursor: PageCursor = None,
) -> TaskList:
    """The tenant's tasks, a page at a time (keyset pagination: follow ``next_cursor``)."""
    if status is not None and status not in tuple(TaskStatus):
        raise InvalidRequest("status", f"must be one of {', '.join(TaskStatus)}")
    after = _decode_task_cursor(cursor)
    with session.begin():
        rows, last = tasks.list_tasks(
            session, principal.tenant_id, status=status, agent=agent, limit=limit, after_id=after
        )
        links = principal.allows(APPROVE)
        items = [task_view(t, approval_links=links) for t in rows]
    return TaskList(items=items, next_cursor=params.next_cursor(last))


def _decode_task_cursor(cursor: str | None) -> str | None:
    after = cursor_after(cursor)
    if after is not None:
        try:
            uuid.UUID(after)
        except ValueError:
            raise InvalidRequest("cursor", "not a cursor this API returned") from None
    return after


@router.get(
    "/{task_id}/children",
    response_model=TaskList,
    summary="The sub-agent tasks a task started",
    responses=TASK_RESPONSES,
)
def list_children(
    task_id: str,
    principal: Reader,
    session: SessionDep,
    limit: PageLimit = 50,
    cursor: PageCursor = None,
) -> TaskList:
    """The tasks the task's sub-agent calls started (one per call), a page at a time; each
    shows its ``parent_id`` and ``root_id``, and ``/children`` of a child goes a level down."""
    after = _decode_task_cursor(cursor)
    with session.begin():
        tasks.get_task(session, principal.tenant_id, task_id)  # 404 across tenants
        rows, last = families.children(session, task_id, limit=limit, after_id=after)
        links = principal.allows(APPROVE)
        items = [task_view(t, approval_links=links) for t in rows]
    return TaskList(items=items, next_cursor=params.next_cursor(last))


@router.post(
    "/{task_id}/cancel",
    status_code=202,
    response_model=TaskView,
    summary="Cancel a task",
    responses=TERMINAL_RESPONSES,
)
def cancel_task(task_id: str, principal: Writer, session: SessionDep) -> TaskView:
    """Cancel now if no worker holds the task; otherwise the step in flight stops waiting on
    its model or tool and cancels the task (``cancel_requested_at`` shows it is pending).
    Every unfinished task it started (its sub-agents, theirs, …) is cancelled the same way.
    409 if the task already ended."""
    task, effects = task_actions.cancel(session, principal.tenant_id, task_id)
    after_commit(effects)
    return task_view(task)


@router.post(
    "/{task_id}/retry",
    status_code=202,
    response_model=TaskView,
    summary="Retry a failed task",
    responses=TERMINAL_RESPONSES,
)
def retry_task(task_id: str, principal: Writer, session: SessionDep) -> TaskView:
    """A failed task resumes from its last committed step. 409 unless failed."""
    task, effects = task_actions.retry(session, principal.tenant_id, task_id)
    after_commit(effects)
    return task_view(task)


@router.get(
    "/{task_id}/steps",
    response_model=StepList,
    summary="The step timeline",
    responses=TASK_RESPONSES,
)
def list_steps(
    task_id: str,
    principal: Reader,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=200, description="at most this many steps")] = 100,
    cursor: PageCursor = None,
) -> StepList:
    """The step timeline: each model call and the tool calls it asked for."""
    after = cursor_after(cursor)
    after_step = 0 if after is None else parse_seq(after, field="cursor")
    with session.begin():
        task = tasks.get_task(session, principal.tenant_id, task_id)
        steps = checkpoints.load_steps(session, task_id, after=after_step, limit=limit + 1)
        more = len(steps) > limit
        steps = steps[:limit]
        calls = ledger.calls_for_task(session, task_id, steps=[s.number for s in steps])
        parked = store_waits.of_calls(session, task_id, [c.call_id for c in calls])
        inherited = (task.forked_from or {}).get("step", 0)  # a fork's steps from its origin
        items = [
            _step_out(
                s,
                [c for c in calls if c.step_number == s.number],
                model=task.model,
                forked=s.number <= inherited,
                parked=parked,
            )
            for s in steps
        ]
        summaries = [_summary_out(row) for row in list_summaries(session, task_id)]
    next_cursor = params.encode_cursor(str(steps[-1].number)) if more else None
    failed = (task.waiting or {}).get("model_attempts") or (task.error or {}).get("attempts")
    return StepList(
        items=items,
        next_cursor=next_cursor,
        waiting=task.waiting,
        failed_model_calls=[FailedModelCall.model_validate(call) for call in failed or []],
        summaries=summaries,
    )


def _summary_out(row: Summary) -> SummaryOut:
    return SummaryOut(
        number=row.number,
        through_step=row.through_step,
        content=row.content,
        model=row.model,
        usage=Usage(
            input_tokens=row.input_tokens,
            output_tokens=row.output_tokens,
            cost_usd=round(row.cost_usd, 8) if row.cost_usd or is_priced(row.model) else None,
        ),
        created_at=aware(row.created_at),
    )


def _step_out(
    step: Step,
    calls: list[ToolCall],
    *,
    model: str,
    forked: bool,
    parked: dict[str, dict[str, Any]],
) -> StepOut:
    return StepOut(
        number=step.number,
        forked=forked,
        status=checkpoints.status(step),
        model=step.response,
        usage=StepUsage(
            **usage_of(step, model=model).model_dump(), prompt_tokens=step.prompt_tokens
        ),
        model_latency_ms=step.model_latency_ms,
        started_at=aware(step.started_at),
        model_completed_at=aware(step.model_completed_at),
        completed_at=aware(step.completed_at),
        tool_calls=[
            ToolCallOut(
                call_id=c.call_id,
                provider_call_id=c.provider_call_id,
                name=c.tool,
                arguments=c.arguments,
                status=c.status,
                result=c.result,
                error=c.error,
                # An inherited call ran, with its key, in the task it was forked from.
                idempotency_key=ledger.idempotency_key(c.inherited_from or c.task_id, c.call_id),
                runs=c.runs,
                started_at=aware(c.started_at),
                finished_at=aware(c.finished_at),
                approval=_approval(c),
                wait=parked.get(c.call_id),
            )
            for c in calls
        ],
    )


def _approval(call: ToolCall) -> CallApproval | None:
    if call.approval_deadline_ms is None:
        return None
    return CallApproval(
        deadline=datetime.fromtimestamp(call.approval_deadline_ms / 1000, UTC),
        on_timeout=call.approval_on_timeout,
        decision=call.decision,
        decided_by=call.decided_by,
        decided_at=aware(call.decided_at),
        reason=call.decision_reason,
        original_arguments=call.original_arguments,
    )
