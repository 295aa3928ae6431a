"""``/v1/secrets``: a tenant admin sets, lists and deletes its tenant's secrets.

A value goes in and never comes out: the list names each secret with its dates. Tools that
declare a secret (``@tool(secrets=("NAME",))``) read it in the worker. Each change is
recorded in the audit log with the key that made it. Another tenant's secret is not found.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from api.deps import Admin, SessionDep
from api.problems import responses
from api.schemas.secrets import SecretList, SecretOut, SecretPut
from shared.actions import secrets as secret_actions
from shared.store.audit import actor_of_key
from shared.store.tables import Secret
from shared.views import aware

router = APIRouter(prefix="/v1/secrets", tags=["secrets"])
NOT_FOUND = "no such secret (another tenant's is not found either)"
NameParam = Annotated[
    str,
    Path(
        pattern=secret_actions.NAME_PATTERN,
        description="1 to 64 of A-Z, 0-9 and _, starting with a letter",
    ),
]


def _out(row: Secret) -> SecretOut:
    return SecretOut(
        name=row.name, created_at=aware(row.created_at), updated_at=aware(row.updated_at)
    )


@router.get("", response_model=SecretList, summary="List the tenant's secrets")
def list_secrets(
    principal: Admin,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=200, description="at most this many")] = 50,
    cursor: Annotated[
        str | None,
        Query(
            max_length=100,
            pattern=r"^[^\x00-\x1f\x7f]+$",
            description="``next_cursor`` of the page before (the last name it listed)",
        ),
    ] = None,
) -> SecretList:
    """The tenant's secrets by name, with when each was created and last set; never a value.
    A page's cursor is the name it ends with (any text is a cursor: none is refused)."""
    rows = secret_actions.list_secrets(
        session, principal.tenant_id, after=cursor or None, limit=limit + 1
    )
    items = [_out(row) for row in rows[:limit]]
    more = len(rows) > limit
    return SecretList(items=items, next_cursor=items[-1].name if more else None)


@router.put(
    "/{name}",
    response_model=SecretOut,
    summary="Set a secret",
    responses={
        201: {"description": "the secret was created", "model": SecretOut},
        **responses(
            {
                409: "secrets are not configured on this server (RATCHET_SECRETS_KEY)",
                422: "the name or the value is invalid",
            }
        ),
    },
)
def put_secret(
    name: NameParam, body: SecretPut, principal: Admin, session: SessionDep, response: Response
) -> SecretOut:
    """Create the secret, or replace its value; 201 if it is new. The value is encrypted at
    rest and never returned; tools that declare the name read it from their next call on."""
    row, created = secret_actions.set_secret(
        session, principal.tenant_id, name, body.value, actor=actor_of_key(principal.key_id)
    )
    response.status_code = 201 if created else 200
    return _out(row)


@router.delete(
    "/{name}",
    status_code=204,
    response_class=Response,
    summary="Delete a secret",
    responses=responses({404: NOT_FOUND}),
)
def delete_secret(name: NameParam, principal: Admin, session: SessionDep) -> Response:
    """Delete the secret: tools that declare it no longer get it from their next call on."""
    secret_actions.delete_secret(
        session, principal.tenant_id, name, actor=actor_of_key(principal.key_id)
    )
    return Response(status_code=204)
