"""Dependencies: the database session and the calling principal."""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated, Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import Depends, HTTPException, Request
from sqlalchemy.orm import Session

from shared.errors import KeyRejected
from shared.ids import hash_secret
from shared.settings import Settings
from shared.store.db import get_sessionmaker
from shared.store.tenants import ADMIN, OPERATOR, Principal, verify_key

T = TypeVar("T")
CHALLENGE = {"WWW-Authenticate": "Bearer"}


def get_session() -> Iterator[Session]:
    with get_sessionmaker()() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def bearer_key(request: Request) -> str:
    """The key of the one ``Authorization: Bearer <key>`` header, taken exactly as sent:
    nothing is stripped, so a key with stray characters around it is not a key."""
    headers = request.headers.getlist("authorization")
    if len(headers) > 1:
        raise HTTPException(400, "send exactly one Authorization header")
    scheme, space, key = (headers[0] if headers else "").partition(" ")
    if scheme.lower() != "bearer" or not space or not key:
        raise HTTPException(401, "send an API key as 'Authorization: Bearer <key>'", CHALLENGE)
    return key


class KeyCache:
    """Keys verified in the last second, so a burst of requests with one key reads the
    database once, and a request whose key is known never waits for a thread.

    An entry lives :data:`KEY_CACHE_SECONDS`: a key revoked (or expiring) elsewhere is
    refused within that; a key revoked through this process is forgotten at once."""

    def __init__(self, seconds: float, *, size: int = 10_000) -> None:
        self.seconds = seconds
        self.size = size
        self._entries: OrderedDict[str, tuple[Principal, float]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Principal | None:
        digest = hash_secret(key)
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None or entry[1] <= time.monotonic():
                return None
            return entry[0]

    def put(self, key: str, principal: Principal) -> None:
        with self._lock:
            self._entries[hash_secret(key)] = (principal, time.monotonic() + self.seconds)
            self._entries.move_to_end(hash_secret(key))
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def forget(self, key_id: str) -> None:
        """Drop a key revoked or rotated here: its next request reads the database."""
        with self._lock:
            for digest in [d for d, (p, _) in self._entries.items() if p.key_id == key_id]:
                del self._entries[digest]


KEY_CACHE_SECONDS = 1.0
verified_keys = KeyCache(KEY_CACHE_SECONDS)


def _verify(key: str) -> Principal:
    with get_sessionmaker()() as session:
        try:
            with session.begin():
                principal = verify_key(session, key)
        except KeyRejected as exc:
            raise HTTPException(401, str(exc), CHALLENGE) from None
    verified_keys.put(key, principal)
    return principal


async def get_principal(request: Request) -> Principal:
    """The caller, from its key: from the last second's verifications if it is there (no
    thread, no database), else verified on the thread pool."""
    key = bearer_key(request)
    principal = verified_keys.get(key)
    if principal is None:
        principal = await with_connection(request, _verify, key)
    return principal


def connection_turns(settings: Settings) -> anyio.CapacityLimiter:
    """The API's turns at its database pool (made in its lifespan, on its event loop)."""
    return anyio.CapacityLimiter(settings.db_pool_size)


async def with_connection(request: Request, func: Callable[..., T], *args: Any) -> T:
    """``func(*args)`` on the thread pool, which takes and gives back one database connection,
    once one of the pool's connections is free for it: a burst of requests waits here, on the
    event loop, not in threads past the pool's size that each open a connection of their own
    (and close it again: the churn cost more than the rest of a submission)."""
    turns = getattr(request.app.state, "connection_turns", None)
    return await anyio.to_thread.run_sync(functools.partial(func, *args), limiter=turns)


def require(scope: str) -> Callable[[Principal], Awaitable[Principal]]:
    async def check(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
        if not principal.allows(scope):
            raise HTTPException(403, f"this API key lacks the {scope!r} scope")
        return principal

    return check


Reader = Annotated[Principal, Depends(require("tasks:read"))]
Writer = Annotated[Principal, Depends(require("tasks:write"))]
Approver = Annotated[Principal, Depends(require("tasks:approve"))]
Admin = Annotated[Principal, Depends(require(ADMIN))]
Operator = Annotated[Principal, Depends(require(OPERATOR))]
