"""``/v1/waits/{token}``: read a durable wait, and complete it, once.

Completed by an API key with ``tasks:write`` of the wait's tenant, or by the wait's signed
URL (``?signature=…``, no key): the URL a tool hands to a third party (a CI system, a
payment provider, a person's email), as approval links are."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool

from api.deps import SessionDep, get_principal
from api.problems import responses
from api.schemas.waits import WaitOut
from shared.actions import waits as wait_actions
from shared.actions.effects import after_commit
from shared.approvals.links import LinkRefused, verify_wait
from shared.errors import InvalidRequest, NotFound
from shared.store import waits as store
from shared.store.tables import Wait
from shared.store.tenants import Principal
from shared.views import aware

router = APIRouter(prefix="/v1/waits", tags=["waits"])
MAX_RESULT_BYTES = 256 * 1024
Signature = Annotated[
    str | None,
    Query(max_length=200, description="the signature of the wait's URL (then no API key)"),
]


def wait_out(wait: Wait) -> WaitOut:
    deadline = None
    if wait.deadline_ms is not None:
        deadline = datetime.fromtimestamp(wait.deadline_ms / 1000, UTC)
    created_at = aware(wait.created_at)
    assert created_at is not None
    return WaitOut(
        token=wait.token,
        task_id=wait.task_id,
        call_id=wait.call_id,
        kind=wait.kind,
        child_id=wait.child_id,
        status=wait.status,
        request=wait.request,
        result=wait.payload,
        error=wait.error,
        deadline=deadline,
        on_timeout=wait.on_timeout,
        created_at=created_at,
        settled_at=aware(wait.settled_at),
        settled_by=wait.settled_by,
    )


async def _caller(
    request: Request, token: str, signature: str | None, scope: str
) -> Principal | None:
    """The caller's key (with ``scope``), or None for a valid signed URL."""
    if signature is not None:
        try:
            verify_wait(token, signature)
        except LinkRefused as exc:
            raise NotFound(f"no wait {token}: {exc}") from None
        return None
    principal: Principal = await get_principal(request)
    if not principal.allows(scope):
        raise HTTPException(403, f"this API key lacks the {scope!r} scope")
    return principal


@router.get(
    "/{token}",
    response_model=WaitOut,
    summary="A durable wait",
    responses=responses({404: "no such wait (or another tenant's)"}),
)
async def get_wait(
    token: str, request: Request, session: SessionDep, signature: Signature = None
) -> WaitOut:
    """What the wait is for (its ``request``), and whether it was settled."""
    caller = await _caller(request, token, signature, "tasks:read")
    tenant_id = caller.tenant_id if caller is not None else None

    def read() -> WaitOut:
        with session.begin():
            wait = store.by_token(session, token)
            if wait is None or (tenant_id is not None and wait.tenant_id != tenant_id):
                raise NotFound(f"no wait {token}")
            return wait_out(wait)

    return await run_in_threadpool(read)


@router.post(
    "/{token}",
    response_model=WaitOut,
    summary="Complete a durable wait",
    responses=responses(
        {
            404: "no such wait (or another tenant's), or a signature that is not its URL's",
            409: "the wait was already settled (completed, expired or cancelled), or it waits "
            "for a child task",
            422: "the body is not JSON, or is too large",
        }
    ),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"description": "any JSON value"}}},
        }
    },
)
async def complete_wait(
    token: str, request: Request, session: SessionDep, signature: Signature = None
) -> WaitOut:
    """Complete the wait with the JSON body, which becomes the waiting tool call's result,
    committed once: a second completion is a 409 and changes nothing. When it was the last
    wait of its task's step, the task runs on."""
    caller = await _caller(request, token, signature, "tasks:write")
    tenant_id = caller.tenant_id if caller is not None else None
    payload = _json_body(await request.body())
    by = "signed link" if caller is None else f"key:{caller.key_id}"

    def complete() -> WaitOut:
        wait, effects = wait_actions.complete(session, token, payload, tenant_id=tenant_id, by=by)
        out = wait_out(wait)
        after_commit(effects)
        return out

    return await run_in_threadpool(complete)


def _json_body(raw: bytes) -> Any:
    if len(raw) > MAX_RESULT_BYTES:
        raise InvalidRequest("body", f"must be at most {MAX_RESULT_BYTES} bytes")
    try:
        return json.loads(raw) if raw.strip() else None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest("body", f"not JSON: {exc}") from None
