"""Dependencies: the database session and the calling principal."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from sqlalchemy.orm import Session

from shared.db import get_sessionmaker
from shared.tenants import Principal, authenticate


def get_session() -> Iterator[Session]:
    with get_sessionmaker()() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def get_principal(request: Request, session: SessionDep) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise HTTPException(
            401,
            "send an API key as 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    with session.begin():
        principal = authenticate(session, key.strip())
    if principal is None:
        raise HTTPException(401, "the API key is not valid", headers={"WWW-Authenticate": "Bearer"})
    return principal


def require(scope: str) -> Callable[[Principal], Principal]:
    def check(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
        if not principal.allows(scope):
            raise HTTPException(403, f"this API key lacks the {scope!r} scope")
        return principal

    return check


Reader = Annotated[Principal, Depends(require("tasks:read"))]
Writer = Annotated[Principal, Depends(require("tasks:write"))]
Admin = Annotated[Principal, Depends(require("admin"))]
