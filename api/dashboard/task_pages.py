"""The task list (filters in the URL, keyset pages, bulk cancel and retry) and the task page
(steps, conversation, events, webhook deliveries, cancel and retry; its family of sub-agent
tasks and its durable waits, each pending one with a form that completes it), and the task's
event stream for a session: the API's stream (``api.task_events``), its live
``message.delta`` events included, so the page shows the answer as the model writes it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from api import task_events as event_stream
from api.dashboard.auth import PATH, CheckedLogin, CurrentLogin
from api.dashboard.pages import scope_of
from api.dashboard.render import page
from api.params import event_position
from api.schemas.content import decoded_size
from api.stream_limits import limits
from shared.actions import tasks as task_actions
from shared.actions import waits as wait_actions
from shared.actions import webhooks as webhook_actions
from shared.actions.effects import after_commit
from shared.agents.registry import get_registry
from shared.deltas import Cursor
from shared.errors import InvalidRequest, NotFound, RatchetError
from shared.ops import search
from shared.ops.search import TaskFilter
from shared.ops.sessions import Login
from shared.statuses import TERMINAL_STATUSES, TaskStatus
from shared.store import checkpoints, families, ledger
from shared.store import waits as wait_store
from shared.store.db import get_sessionmaker
from shared.store.events import list_events
from shared.store.summaries import list_summaries
from shared.store.tables import Step, Task, Wait, utcnow
from shared.views import aware, task_view, usage_of
from shared.webhooks import deliveries as webhook_deliveries

router = APIRouter(prefix=PATH, include_in_schema=False)
PAGE = 50
TREE_MOST = 200  # tasks of a family tree shown on a task page (the rest: a note)
MAX_RESULT_BYTES = 256 * 1024  # a wait's result from the page, as the API takes at most
FILTERS = (
    *("tenant", "status", "agent", "model", "metadata", "error"),
    *("created_after", "created_before", "id"),
)
ACTIONS = {  # action → (the states it applies to, the verb shown)
    "cancel": (
        (TaskStatus.QUEUED, TaskStatus.RUNNING, TaskStatus.AWAITING_APPROVAL, TaskStatus.WAITING),
        "cancel",
    ),
    "retry": ((TaskStatus.FAILED,), "retry"),
}


def _when(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        raise InvalidRequest(
            "time", f"{value!r} is not a date and time (YYYY-MM-DDTHH:MM)"
        ) from None


def task_filter(values: dict[str, Any], login: Login) -> TaskFilter:
    """A filter from query or form values; a tenant admin's ``tenant`` is ignored."""
    text = {k: (str(values.get(k) or "").strip() or None) for k in FILTERS}
    return TaskFilter(
        tenant=text["tenant"] if login.operator else None,
        status=text["status"],
        agent=text["agent"],
        model=text["model"],
        metadata=text["metadata"],
        error=text["error"],
        created_after=_when(text["created_after"]),
        created_before=_when(text["created_before"]),
        id=text["id"],
    )


def _list(login: Login, where: TaskFilter, after: str | None) -> dict[str, Any]:
    with get_sessionmaker()() as session, session.begin():
        rows, next_id = search.search(session, scope_of(login), where, limit=PAGE, after_id=after)
        names = search.tenant_names(session, [t.tenant_id for t in rows])
    return {"tasks": rows, "next_id": next_id, "tenants": names}


@router.get("/tasks", response_class=HTMLResponse)
async def tasks_page(
    request: Request, login: CurrentLogin, after: Annotated[str | None, Query(max_length=64)] = None
) -> Response:
    values = dict(request.query_params)
    try:
        where = task_filter(values, login)
    except InvalidRequest as exc:
        return page(request, "tasks.html", login, error=str(exc), params={}, tasks=[], **_lists())
    found = await run_in_threadpool(_list, login, where, after)
    return page(
        request, "tasks.html", login, error=None, params=where.as_params(), **found, **_lists()
    )


def _lists() -> dict[str, Any]:
    return {"states": tuple(TaskStatus), "agents": sorted(get_registry().agents)}


def _matching(
    login: Login, where: TaskFilter, action: str, ids: list[str]
) -> list[tuple[str, str]]:
    states = ACTIONS[action][0]
    with get_sessionmaker()() as session, session.begin():
        found = search.matching_ids(session, scope_of(login), where, status=states)
    if ids:  # the selection: only the selected tasks among those the filter may touch
        chosen = set(ids)
        found = [(t, i) for t, i in found if i in chosen]
    return found


def _apply(action: str, targets: list[tuple[str, str]]) -> tuple[int, int]:
    """Cancel or retry each target in its own transaction; (changed, skipped)."""
    act = task_actions.cancel if action == "cancel" else task_actions.retry
    changed = 0
    for tenant_id, task_id in targets:
        with get_sessionmaker()() as session:
            try:
                _, effects = act(session, tenant_id, task_id)
            except RatchetError:  # it changed state meanwhile (finished, retried elsewhere)
                continue
        after_commit(effects)
        changed += 1
    return changed, len(targets) - changed


@router.post("/tasks/bulk", response_class=HTMLResponse)
async def bulk(request: Request, login: CheckedLogin) -> Response:
    """Two steps: the first post counts what would change and asks to confirm; the second
    (``confirmed``) changes it and says how many changed."""
    form = await request.form()
    action, _, scope = str(form.get("action") or "").partition(":")
    scope = str(form.get("scope") or scope)
    if action not in ACTIONS:
        return page(request, "error.html", login, status=422, message="choose cancel or retry")
    ids = [str(i) for i in form.getlist("ids")]
    if scope != "matching" and not ids:
        return page(request, "error.html", login, status=422, message="select some tasks first")
    where = task_filter(dict(form), login)
    targets = await run_in_threadpool(
        _matching, login, where, action, [] if scope == "matching" else ids
    )
    if form.get("confirmed") != "yes":
        return page(
            request,
            "confirm.html",
            login,
            action=action,
            count=len(targets),
            ids=ids,
            params=where.as_params(),
            scope=scope,
        )
    changed, skipped = await run_in_threadpool(_apply, action, targets)
    verb = "Cancelled" if action == "cancel" else "Retried"
    flash = f"{verb} {changed} task(s)" + (f"; {skipped} had changed meanwhile" if skipped else "")
    return RedirectResponse(
        f"{PATH}/tasks?{urlencode({**where.as_params(), 'flash': flash})}", status_code=303
    )


def _task_row(session: Session, login: Login, task_id: str) -> Task:
    query = select(Task).where(Task.id == task_id)
    if not login.operator:
        query = query.where(Task.tenant_id == login.principal.tenant_id)
    task = session.scalar(query)
    if task is None:
        raise NotFound(f"no task {task_id}")
    return task


def shown_input(value: Any) -> Any:
    """A task's input as its page shows it: an image's or a file's base64 data as its size
    (the page would otherwise carry megabytes of it)."""
    if isinstance(value, str):
        return value
    return [
        message
        if isinstance(message.get("content"), str)
        else message | {"content": [_shown_part(part) for part in message["content"]]}
        for message in value
    ]


def _shown_part(part: dict[str, Any]) -> dict[str, Any]:
    if "data" not in part:
        return part
    return part | {"data": f"({decoded_size(part['data']):,} bytes of base64)"}


def _task(login: Login, task_id: str) -> dict[str, Any]:
    with get_sessionmaker()() as session, session.begin():
        task = _task_row(session, login, task_id)
        steps = checkpoints.load_steps(session, task_id, after=0, limit=500)
        calls = ledger.calls_for_task(session, task_id, steps=[s.number for s in steps])
        summaries = list(list_summaries(session, task_id))
        events = list_events(session, task_id, limit=1000)
        deliveries, attempts, _ = webhook_deliveries.list_for_task(
            session, task_id, after=None, limit=100
        )
        tenant = search.tenant_names(session, [task.tenant_id])[task.tenant_id]
        family = _family(session, task)
        waits = _waits(session, task_id)
    by_step: dict[int, list[Any]] = {}
    for call in calls:
        by_step.setdefault(call.step_number, []).append(call)
    return family | {
        "waits": waits,
        "wait_tools": {c.call_id: c.tool for c in calls},
        "task": task,
        "tenant": tenant,
        "steps": [(s, by_step.get(s.number, [])) for s in steps],
        "bars": waterfall(task, steps),
        # Cost unknown (None) for a model with no price, rather than $0.
        "usage": usage_of(task, model=task.model),
        "step_usage": {s.number: usage_of(s, model=task.model) for s in steps},
        "summaries": summaries,
        "shown_input": shown_input(task.input),
        "events": events,
        "deliveries": [(d, attempts.get(d.id, [])) for d in deliveries],
        "terminal": task.status in TERMINAL_STATUSES,
        "step_status": checkpoints.status,  # derived, not stored (nor is a call's key)
        "call_key": ledger.idempotency_key,
    }


def _family(session: Session, task: Task) -> dict[str, Any]:
    """The task's parent and root (each None when it is the task, or the root its parent),
    the tree of tasks below it, and what its settled children used."""
    parent = session.get(Task, task.parent_id) if task.parent_id else None
    root = None
    if task.root_id and task.root_id not in (task.id, task.parent_id):
        root = session.get(Task, task.root_id)
    tree, more = family_tree(session, task.id)
    view = task_view(task)
    return {
        "parent": parent,
        "root": root,
        "tree": [(depth, row, task_view(row).usage) for depth, row in tree],
        "tree_more": more,
        "children_usage": view.children_usage,
        "total_usage": view.usage,
    }


def family_tree(
    session: Session, task_id: str, *, most: int = TREE_MOST
) -> tuple[list[tuple[int, Task]], bool]:
    """The tasks below ``task_id``, each after its parent and in the order its parent's calls
    started them, with its depth below the task (1: a child); at most ``most`` of them, and
    whether more were left out. The depth limit bounds the recursion."""
    shown: list[tuple[int, Task]] = []

    def visit(parent_id: str, depth: int) -> bool:
        rows, next_id = families.children(session, parent_id, limit=most)
        for row in rows:
            if len(shown) == most:
                return True
            shown.append((depth, row))
            if visit(row.id, depth + 1):
                return True
        return next_id is not None

    return shown, visit(task_id, 1)


def _waits(session: Session, task_id: str) -> list[Wait]:
    """Every durable wait of the task's calls, settled or not, in the order they parked."""
    query = select(Wait).where(Wait.task_id == task_id)
    return list(session.scalars(query.order_by(Wait.step_number, Wait.created_at)))


def waterfall(task: Task, steps: Sequence[Step]) -> dict[int, dict[str, float]]:
    """Each step's bar as percentages of the task's span: where it starts, how long the
    model took, and how long its tools took after that."""
    start = aware(task.started_at) or aware(task.created_at)
    ends = [aware(s.completed_at) or aware(s.model_completed_at) for s in steps]
    end = max([e for e in ends if e] + [aware(task.finished_at) or utcnow()])
    if start is None:
        return {}
    span = max((end - start).total_seconds(), 0.001)

    def pct(moment: datetime | None) -> float:
        return 0.0 if moment is None else max(0.0, (moment - start).total_seconds() / span * 100)

    bars = {}
    for s in steps:
        left, model = pct(aware(s.started_at)), pct(aware(s.model_completed_at))
        done = pct(aware(s.completed_at)) if s.completed_at else model
        bars[s.number] = {
            "left": left,
            "model": max(model - left, 0.3),
            "tools": max(done - model, 0),
        }
    return bars


@router.get("/tasks/{task_id}", response_class=HTMLResponse)
async def task_page(request: Request, login: CurrentLogin, task_id: str) -> Response:
    try:
        data = await run_in_threadpool(_task, login, task_id)
    except NotFound as exc:
        return page(request, "error.html", login, status=404, message=str(exc))
    return page(request, "task.html", login, **data)


async def stream_slot(login: CurrentLogin) -> AsyncIterator[Login]:
    """The session, holding one of its tenant's stream slots (as an API key's stream does)
    until the response has been sent."""
    with limits.hold(login.principal.tenant_id):
        yield login


def _tenant_of(login: Login, task_id: str) -> str:
    with get_sessionmaker()() as session, session.begin():
        return _task_row(session, login, task_id).tenant_id


@router.get("/tasks/{task_id}/events")
async def task_events(
    request: Request,
    login: Annotated[Login, Depends(stream_slot)],
    task_id: str,
    after: Annotated[int | None, Query(ge=0)] = None,
    last_event_id: Annotated[str | None, Header(max_length=40)] = None,
) -> Response:
    """The task's event stream (SSE) for the page's script: the same stream as
    ``GET /v1/tasks/{id}/events``, read with the session's scope (a tenant admin's own tasks,
    an operator's any). Approval links are left out: the page has its own decision forms."""
    seq, pos = event_position(after, last_event_id)
    try:
        tenant_id = await run_in_threadpool(_tenant_of, login, task_id)
    except NotFound as exc:
        return page(request, "error.html", login, status=404, message=str(exc))
    stream = event_stream.stream(
        request, tenant_id, task_id, Cursor.resuming(seq, pos), approval_links=False
    )
    return StreamingResponse(
        stream,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _act(login: Login, task_id: str, action: str) -> str:
    with get_sessionmaker()() as session:
        with session.begin():
            tenant_id = _task_row(session, login, task_id).tenant_id
        act = task_actions.cancel if action == "cancel" else task_actions.retry
        try:
            _, effects = act(session, tenant_id, task_id)
        except RatchetError as exc:
            return str(exc)
    after_commit(effects)
    return "Cancellation requested" if action == "cancel" else "Retried: the task is queued"


@router.post("/tasks/{task_id}/{action}", response_class=HTMLResponse)
async def task_action(request: Request, login: CheckedLogin, task_id: str, action: str) -> Response:
    if action not in ACTIONS:
        return page(request, "error.html", login, status=404, message=f"no action {action!r}")
    try:
        flash = await run_in_threadpool(_act, login, task_id, action)
    except NotFound as exc:
        return page(request, "error.html", login, status=404, message=str(exc))
    return _to_task(task_id, flash)


def wait_result(form: dict[str, str]) -> Any:
    """The result a wait's form sends: its text as it is, or (``format`` "json") as JSON."""
    text = form.get("result", "")
    if len(text.encode()) > MAX_RESULT_BYTES:
        raise InvalidRequest("result", f"must be at most {MAX_RESULT_BYTES} bytes")
    if form.get("format") != "json":
        return text
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRequest("result", f"not JSON: {exc}") from None


def _complete(login: Login, task_id: str, token: str, form: dict[str, str]) -> str:
    """Complete the task's wait ``token`` from the page, as the session's key would; the
    task's tenant is the session's own (an operator acts in the task's)."""
    result = wait_result(form)
    with get_sessionmaker()() as session:
        with session.begin():
            tenant_id = _task_row(session, login, task_id).tenant_id
            found = wait_store.by_token(session, token)
            if found is None or found.task_id != task_id:
                raise NotFound(f"no wait {token} on task {task_id}")
        wait, effects = wait_actions.complete(
            session,
            token,
            result,
            tenant_id=tenant_id,
            by=f"key:{login.principal.key_id} (dashboard)",
        )
    after_commit(effects)
    return f"Completed the wait of call {wait.call_id}: the task runs on with its result"


@router.post("/tasks/{task_id}/waits/{token}", response_class=HTMLResponse)
async def complete_wait(
    request: Request, login: CheckedLogin, task_id: str, token: str
) -> Response:
    """A pending wait's form: its result becomes the waiting call's result, once (a wait
    settled meanwhile is said so, and nothing changes)."""
    form = {k: str(v) for k, v in (await request.form()).items()}
    try:
        flash = await run_in_threadpool(_complete, login, task_id, token, form)
    except NotFound as exc:
        return page(request, "error.html", login, status=404, message=str(exc))
    except RatchetError as exc:
        flash = f"Not completed: {exc}"
    return _to_task(task_id, flash)


def _redeliver(login: Login, delivery_id: str, tenant_id: str) -> None:
    with get_sessionmaker()() as session:
        redelivered = webhook_actions.redeliver(session, tenant_id, delivery_id)
    after_commit(redelivered.effects)


@router.post("/tasks/{task_id}/deliveries/{delivery_id}/redeliver")
async def redeliver(login: CheckedLogin, task_id: str, delivery_id: str) -> Response:
    def run() -> str:
        with get_sessionmaker()() as session, session.begin():
            tenant_id = _task_row(session, login, task_id).tenant_id
        _redeliver(login, delivery_id, tenant_id)
        return "Redelivery queued"

    try:
        flash = await run_in_threadpool(run)
    except NotFound as exc:
        flash = str(exc)
    return _to_task(task_id, flash)


def _to_task(task_id: str, flash: str) -> RedirectResponse:
    return RedirectResponse(
        f"{PATH}/tasks/{task_id}?{urlencode({'flash': flash})}", status_code=303
    )
