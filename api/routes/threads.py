"""``/v1/threads``: create, read, list and delete threads, send a turn, read the conversation.

A turn is a task (``POST /v1/threads/{id}/runs`` answers as ``POST /v1/tasks`` does, with the
task's ``thread_id`` and ``turn``); ``shared.actions.threads`` says what a turn does to a
thread that has one unfinished. The thread's one event stream is ``api.routes.thread_events``.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from api import idempotency, params, submission
from api.deps import Reader, SessionDep, Writer, with_connection
from api.params import PageCursor, PageLimit, cursor_after, parse_seq
from api.problems import responses
from api.routes.tasks import SUBMIT_RESPONSES
from api.schemas.threads import (
    ForkOrigin,
    MessageList,
    MessageOut,
    ThreadCreate,
    ThreadFork,
    ThreadList,
    ThreadView,
    TurnCreate,
)
from shared.actions import threads as thread_actions
from shared.actions.tasks import Submitted
from shared.actions.threads import Strategy
from shared.errors import InvalidRequest
from shared.settings import get_settings
from shared.store import threads
from shared.store.db import get_sessionmaker
from shared.store.ledger import CallStatus
from shared.store.tables import Task, Thread
from shared.store.tenants import Principal
from shared.store.threads import PastTurn
from shared.views import aware, task_view

router = APIRouter(prefix="/v1/threads", tags=["threads"])
THREAD_RESPONSES = responses({404: "no such thread (another tenant's thread is not found either)"})
METADATA_PARAM = re.compile(r"^metadata\.(.{1,100})$")
MAX_METADATA_FILTERS = 10


def thread_view(thread: Thread, latest: Task | None) -> ThreadView:
    created_at, updated_at = aware(thread.created_at), aware(thread.updated_at)
    assert created_at is not None
    assert updated_at is not None
    return ThreadView(
        id=thread.id,
        agent=thread.agent,
        status=threads.thread_status(latest),
        turns=thread.turns,
        metadata=thread.meta,
        created_at=created_at,
        updated_at=updated_at,
        latest_turn=task_view(latest) if latest is not None else None,
        forked_from=(
            ForkOrigin(thread_id=thread.forked_from, turn=thread.fork_turn or 0)
            if thread.forked_from is not None
            else None
        ),
    )


@router.post(
    "",
    status_code=201,
    response_model=ThreadView,
    summary="Create a thread",
    responses=responses({422: "the body is invalid, or names an unknown agent"}),
)
def create_thread(
    body: ThreadCreate, principal: Writer, session: SessionDep, response: Response
) -> ThreadView:
    """A conversation with ``agent``: send it turns with ``POST /v1/threads/{id}/runs``.
    Needs the ``tasks:write`` scope."""
    thread = thread_actions.create(
        session, principal.tenant_id, agent=body.agent, metadata=body.metadata
    )
    response.headers["Location"] = f"/v1/threads/{thread.id}"
    return thread_view(thread, None)


@router.get(
    "/{thread_id}", response_model=ThreadView, summary="Read a thread", responses=THREAD_RESPONSES
)
def get_thread(thread_id: str, principal: Reader, session: SessionDep) -> ThreadView:
    """The thread: its status (as its latest turn leaves it), metadata and latest turn."""
    with session.begin():
        thread = threads.get_thread(session, principal.tenant_id, thread_id)
        return thread_view(thread, threads.latest_turn(session, thread.id))


@router.get(
    "",
    response_model=ThreadList,
    summary="List threads, newest first",
    responses=responses({422: "a filter or the cursor is invalid"}),
)
def list_threads(
    request: Request,
    principal: Reader,
    session: SessionDep,
    agent: Annotated[str | None, Query(max_length=200, description="only this agent's")] = None,
    limit: PageLimit = 50,
    cursor: PageCursor = None,
) -> ThreadList:
    """The tenant's threads, a page at a time (keyset pagination: follow ``next_cursor``).
    ``metadata.<key>=<value>`` (repeatable over keys, at most 10) keeps only the threads whose
    metadata has that key with that value, compared as text: ``?metadata.customer=42``."""
    wanted = _metadata_filters(request)
    after = cursor_after(cursor)
    with session.begin():
        rows, last = threads.list_threads(
            session, principal.tenant_id, metadata=wanted, agent=agent, limit=limit, after_id=after
        )
        latest = threads.latest_turns(session, [t.id for t in rows])
        items = [thread_view(t, latest.get(t.id)) for t in rows]
    return ThreadList(items=items, next_cursor=params.next_cursor(last))


def _metadata_filters(request: Request) -> dict[str, str]:
    wanted: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        if not name.startswith("metadata"):
            continue
        match = METADATA_PARAM.match(name)
        if match is None:
            raise InvalidRequest(name, "filter by metadata as metadata.<key>=<value>")
        key = match.group(1)
        if key in wanted:
            raise InvalidRequest(name, "give each metadata key once")
        if len(value) > 500:
            raise InvalidRequest(name, "must be at most 500 characters")
        wanted[key] = value
    if len(wanted) > MAX_METADATA_FILTERS:
        raise InvalidRequest("metadata", f"at most {MAX_METADATA_FILTERS} metadata filters")
    return wanted


@router.delete(
    "/{thread_id}",
    status_code=204,
    summary="Delete a thread",
    responses=responses(
        {
            404: "no such thread (another tenant's thread is not found either)",
            409: "a turn is unfinished (cancel it first), or the thread has forks",
        }
    ),
)
def delete_thread(thread_id: str, principal: Writer, session: SessionDep) -> Response:
    """Deletes the thread, its turns and everything they wrote. While a turn is unfinished
    the answer is 409: cancel it (``POST /v1/tasks/{id}/cancel``) and delete once it ended."""
    thread_actions.delete(session, principal.tenant_id, thread_id)
    return Response(status_code=204)


@router.post(
    "/{thread_id}/fork",
    status_code=201,
    response_model=ThreadView,
    summary="Fork a thread at a turn",
    responses=responses(
        {
            404: "no such thread (another tenant's thread is not found either)",
            409: "one of the turns to hold is unfinished",
            422: "the body is invalid, or names a turn the thread does not have",
        }
    ),
)
def fork_thread(
    thread_id: str, body: ThreadFork, principal: Writer, session: SessionDep, response: Response
) -> ThreadView:
    """A new thread (same agent) holding turns 1..``turn`` of this one: its next turn reads
    them as their committed steps (no model call or tool call is made again), then its own
    messages. The source is unchanged, and cannot be deleted while it has forks. Needs the
    ``tasks:write`` scope."""
    fork = thread_actions.fork(
        session, principal.tenant_id, thread_id, turn=body.turn, metadata=body.metadata
    )
    response.headers["Location"] = f"/v1/threads/{fork.id}"
    return thread_view(fork, None)


async def turn_body(request: Request, _: Writer) -> TurnCreate:
    """The request body as a TurnCreate, parsed only once the caller may submit."""
    return submission.parse(await request.body(), TurnCreate)


TURN_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TurnCreate"}}},
    }
}
TURN_RESPONSES: dict[int | str, dict[str, Any]] = {
    **SUBMIT_RESPONSES,
    **responses(
        {
            404: "no such thread (another tenant's thread is not found either)",
            409: "``reject``: the thread has a turn unfinished; or a request with the same "
            "Idempotency-Key is still in progress",
        }
    ),
}


@router.post(
    "/{thread_id}/runs",
    status_code=202,
    response_model=None,
    openapi_extra=TURN_BODY,
    summary="Send a turn",
    responses=TURN_RESPONSES,
)
async def run_turn(
    thread_id: str,
    request: Request,
    body: Annotated[TurnCreate, Depends(turn_body)],
    principal: Writer,
    response: Response,
    idempotency_key: Annotated[str | None, idempotency.key_header("the original turn")] = None,
) -> Any:
    """A turn: a task whose conversation is the thread's history and ``input``, the new
    message. Answers at once with the queued task (``thread_id``, ``turn``). When the turn
    in flight asked the person a question (``ask_user``), the message is its answer instead:
    no new turn, and the answer is the turn in flight, which runs on. Needs the
    ``tasks:write`` scope."""
    done = await with_connection(request, _run_turn, principal, thread_id, body, idempotency_key)
    idempotency.answer(response, location=f"/v1/tasks/{done.task.id}", replayed=done.replayed)
    return task_view(done.task)


# A thread's agent never changes: each process reads it once per thread (a thread deleted
# meanwhile is still not found, by the turn's own transaction).
_agents: dict[tuple[str, str], str] = {}
AGENTS_KEPT = 10_000


def _thread_agent(tenant_id: str, thread_id: str) -> str:
    agent = _agents.get((tenant_id, thread_id))
    if agent is None:
        with get_sessionmaker()() as session, session.begin():
            agent = threads.get_thread(session, tenant_id, thread_id).agent
        if len(_agents) >= AGENTS_KEPT:
            _agents.clear()
        _agents[(tenant_id, thread_id)] = agent
    return agent


def _run_turn(principal: Principal, thread_id: str, body: TurnCreate, key: str | None) -> Submitted:
    agent = _thread_agent(principal.tenant_id, thread_id)
    if "agent" in body.model_fields_set and body.agent != agent:
        raise InvalidRequest("agent", f"the thread's agent is {agent!r}; a turn runs it")
    spec = submission.resolve(
        body.model_copy(update={"agent": agent}), get_settings(), tenant_id=principal.tenant_id
    )
    submission.check_rate(principal.tenant_name)
    done = thread_actions.run_turn(
        principal.tenant_id,
        principal.tenant_name,
        thread_id,
        spec,
        strategy=Strategy(body.multitask_strategy),
        idempotency_key=key,
        request_hash=turn_hash(thread_id, body),
    )
    return idempotency.after_submit(done)


def turn_hash(thread_id: str, body: TurnCreate) -> str:
    """The body's hash for its Idempotency-Key, with its thread: the same key and body sent
    to another thread is another request (a 422), not this turn again."""
    both = f"{thread_id}:{submission.request_hash(body)}"
    return hashlib.sha256(both.encode()).hexdigest()


@router.get(
    "/{thread_id}/messages",
    response_model=MessageList,
    summary="The thread's conversation, oldest first",
    responses=responses(
        {
            404: "no such thread (another tenant's thread is not found either)",
            422: "the cursor is invalid",
        }
    ),
)
async def list_messages(
    thread_id: str,
    principal: Reader,
    limit: Annotated[int, Query(ge=1, le=200, description="at most this many messages")] = 100,
    cursor: PageCursor = None,
) -> MessageList:
    """The conversation as the next turn's model reads it: each turn's input, then its
    completed steps (the model's answers, tool calls and their outcomes), turn after turn. A
    turn rolled back is not in it; a step still running shows once it completes."""
    turn, skip = _message_cursor(cursor)
    return await run_in_threadpool(
        _messages_page, principal.tenant_id, thread_id, turn=turn, skip=skip, limit=limit
    )


def _message_cursor(cursor: str | None) -> tuple[int, int]:
    """(turn, messages of it already sent) from a cursor; (1, 0) for the first page."""
    after = cursor_after(cursor)
    if after is None:
        return 1, 0
    turn, _, skip = after.partition(":")
    if not skip:
        raise InvalidRequest("cursor", "not a cursor this API returned")
    return parse_seq(turn, field="cursor"), parse_seq(skip, field="cursor")


def _messages_page(
    tenant_id: str, thread_id: str, *, turn: int, skip: int, limit: int
) -> MessageList:
    with get_sessionmaker()() as session, session.begin():
        threads.get_thread(session, tenant_id, thread_id)
        # Every turn has a message at least: ``limit + 1`` turns fill a page and tell if
        # there is more.
        past = threads.history(session, thread_id, after=turn - 1, limit=limit + 1)
    flat = [
        (one.turn, index, message)
        for one in past
        for index, message in enumerate(turn_messages(one))
        if one.turn != turn or index >= skip
    ]
    page, rest = flat[:limit], flat[limit:]
    after = params.encode_cursor(f"{rest[0][0]}:{rest[0][1]}") if rest else None
    return MessageList(items=[message for _, _, message in page], next_cursor=after)


def turn_messages(past: PastTurn) -> list[MessageOut]:
    """A turn's messages: its input, then each completed step's answer and calls' outcomes."""
    said: list[MessageOut] = []
    base = {"turn": past.turn, "task_id": past.task_id}
    given = past.input
    if isinstance(given, str):
        said.append(MessageOut(**base, role="user", content=given))
    else:
        said += [MessageOut(**base, role=m["role"], content=m["content"]) for m in given]
    for step in past.steps:
        calls = [c for c in past.calls if c.step_number == step.number]
        said.append(
            MessageOut(
                **base,
                role="assistant",
                content=step.response.get("content"),
                tool_calls=step.response.get("tool_calls") or None,
            )
        )
        said += [
            MessageOut(
                **base,
                role="tool",
                content=c.result if c.status == CallStatus.SUCCEEDED else c.error,
                tool_call_id=c.provider_call_id,
                name=c.tool,
                status=c.status,
            )
            for c in calls
        ]
    return said
