"""``/v1/keys``: a tenant admin lists, creates, revokes and rotates its own tenant's API keys.

Keys are listed by prefix, never by hash; the key itself is shown once, in the answer to
create or rotate. Over HTTP a key never gains the ``operator`` scope: only the CLI grants it,
and a key never acts on one with more power than its own (an admin cannot revoke an operator
key). A tenant holds at most ``RATCHET_MAX_KEYS_PER_TENANT`` live keys made here.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from fastapi import APIRouter, HTTPException

from api import params
from api.deps import Admin, SessionDep, verified_keys
from api.params import PageCursor, PageLimit, cursor_after
from api.problems import responses
from api.schemas.keys import KeyCreate, KeyCreated, KeyList, KeyOut, KeyRotate
from shared.actions import keys as key_actions
from shared.actions.keys import BeyondReach
from shared.errors import InvalidRequest
from shared.settings import get_settings
from shared.store import tenants
from shared.store.tables import ApiKey
from shared.store.tenants import OPERATOR
from shared.views import aware

router = APIRouter(prefix="/v1/keys", tags=["keys"])


def _fields(row: ApiKey) -> dict[str, Any]:
    return {
        "id": row.id,
        "prefix": row.prefix,
        "name": row.name,
        "scopes": row.scopes,
        "created_at": aware(row.created_at),
        "expires_at": aware(row.expires_at),
        "last_used_at": aware(row.last_used_at),
        "revoked_at": aware(row.revoked_at),
    }


def _no_operator(scopes: list[str]) -> None:
    if OPERATOR in scopes:
        raise InvalidRequest("scopes", "the operator scope is granted only by the ratchet CLI")


@router.get("", response_model=KeyList, summary="List the tenant's API keys")
def list_keys(
    principal: Admin,
    session: SessionDep,
    limit: PageLimit = 50,
    cursor: PageCursor = None,
) -> KeyList:
    """The tenant's keys, newest first, with their last use (to the minute)."""
    after = cursor_after(cursor)
    with session.begin():
        rows = tenants.list_keys(session, principal.tenant_id, after=after, limit=limit + 1)
        page, next_cursor = params.page_of(rows, limit)
        items = [KeyOut(**_fields(r)) for r in page]
    return KeyList(items=items, next_cursor=next_cursor)


@router.post(
    "",
    status_code=201,
    response_model=KeyCreated,
    summary="Create an API key",
    responses=responses(
        {
            409: "the tenant holds its most live keys (``RATCHET_MAX_KEYS_PER_TENANT``)",
            422: "the body is invalid, or asks for the operator scope (granted only by the CLI)",
        }
    ),
)
def create_key(body: KeyCreate, principal: Admin, session: SessionDep) -> KeyCreated:
    """A new key for the caller's tenant, shown this once; 409 once the tenant holds
    ``RATCHET_MAX_KEYS_PER_TENANT`` live keys (revoked and expired ones do not count)."""
    _no_operator(body.scopes)
    row, key = key_actions.create_key(
        session,
        principal.tenant_id,
        scopes=body.scopes,
        name=body.name,
        expires_at=body.expiry(),
        cap=get_settings().max_keys_per_tenant,
    )
    return KeyCreated(**_fields(row), key=key)


@router.post(
    "/{key_id}/revoke",
    response_model=KeyOut,
    summary="Revoke an API key",
    responses=responses(
        {
            403: "the key is an operator key and the caller's is not, or the caller lacks the "
            "admin scope",
            404: "no such key (another tenant's is not found either)",
        }
    ),
)
def revoke_key(key_id: str, principal: Admin, session: SessionDep) -> KeyOut:
    """Revoke the key: the next request that carries it is refused with 401 (on another API
    process, within a second: each remembers a verified key that long)."""
    operator = OPERATOR in principal.scopes
    try:
        row = key_actions.revoke_key(session, principal.tenant_id, key_id, operator=operator)
    except BeyondReach as exc:
        raise HTTPException(403, str(exc)) from None
    verified_keys.forget(key_id)
    return KeyOut(**_fields(row))


@router.post(
    "/{key_id}/rotate",
    status_code=201,
    response_model=KeyCreated,
    summary="Rotate an API key",
    responses=responses(
        {
            403: "the key is an operator key (rotated only with the ratchet CLI), or the "
            "caller lacks the admin scope",
            404: "no such key (another tenant's is not found either)",
            409: "the key is revoked, already rotated or expired (create a new one)",
        }
    ),
)
def rotate_key(
    key_id: str, principal: Admin, session: SessionDep, body: KeyRotate | None = None
) -> KeyCreated:
    """A new key with the old one's name, scopes and lifetime, shown this once; the old key
    stops working after ``grace_seconds`` (default 0: at once). Only a live key rotates."""
    grace = timedelta(seconds=(body or KeyRotate()).grace_seconds)
    try:
        row, key = key_actions.rotate_key(session, principal.tenant_id, key_id, grace=grace)
    except BeyondReach as exc:
        raise HTTPException(403, str(exc)) from None
    verified_keys.forget(key_id)
    return KeyCreated(**_fields(row), key=key)
