"""Caps on the requests that wait: SSE streams and long polls, per tenant and per process.

A waiting request holds no thread (it waits on the event loop, see api/event_hub.py) but does
hold a connection and reads the database on each wake-up, so one tenant opening thousands of
them would slow every other tenant's requests. Counts are per API process: the event loop is
their only writer, so they need no lock.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from api.deps import get_principal, require
from shared.settings import get_settings
from shared.store.tenants import Principal

RETRY_AFTER_SECONDS = 5


class StreamLimits:
    def __init__(self) -> None:
        self._held: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return self._held.total()

    def held_by(self, tenant_id: str) -> int:
        return self._held[tenant_id]

    @contextlib.contextmanager
    def hold(self, tenant_id: str) -> Iterator[None]:
        """A slot for one waiting request of ``tenant_id``, or a 503 (the process is full) or
        a 429 (the tenant holds its share), both with Retry-After."""
        settings = get_settings()
        retry = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        if self.total >= settings.api_max_streams:
            raise HTTPException(
                503,
                f"the server holds {settings.api_max_streams} streams and long polls, its most; "
                "retry later",
                headers=retry,
            )
        if self._held[tenant_id] >= settings.api_max_streams_per_tenant:
            raise HTTPException(
                429,
                f"this tenant holds {settings.api_max_streams_per_tenant} streams and long polls "
                "open, its most; close one or retry later",
                headers=retry,
            )
        self._held[tenant_id] += 1
        try:
            yield
        finally:
            self._held[tenant_id] -= 1
            if not self._held[tenant_id]:
                del self._held[tenant_id]


limits = StreamLimits()


async def stream_slot(request: Request) -> AsyncIterator[Principal]:
    """The reading principal, holding a stream slot until the response has been sent.

    Authentication is at most one short call on the thread pool (none for a key verified in
    the last second); the slot is held on the event loop, so an open stream holds no thread
    and no database connection."""
    principal = await require("tasks:read")(await get_principal(request))
    with limits.hold(principal.tenant_id):
        yield principal


StreamReader = Annotated[Principal, Depends(stream_slot)]
