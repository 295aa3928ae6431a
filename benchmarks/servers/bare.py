"""The baseline server of ``ratchet bench api``: a bare FastAPI app with one endpoint.

``POST /bare`` inserts the JSON body as one row of ``bench_bare`` straight through psycopg and
answers 202: what accepting a submission costs with nothing between the request and one
INSERT (no key lookup, no validation beyond JSON, no events, no queue). The benchmark creates
and drops the table and serves this with uvicorn in a process of its own::

    python -m uvicorn benchmarks.servers.bare:create_app --factory --port 9200
"""

from __future__ import annotations

import queue
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from benchmarks.harness.common import libpq_url

# psycopg and FastAPI load when the app is made: in the server, not in whatever imports this.
if TYPE_CHECKING:
    import psycopg
    from fastapi import FastAPI

CONNECTIONS = 10  # enough that the server's CPU, not a wait for a connection, sets the pace
INSERT = "INSERT INTO bench_bare (id, body) VALUES (%s, %s)"


class Connections:
    """A fixed set of autocommit connections lent one request at a time: the smallest pool
    that does the job (psycopg_pool is not a dependency)."""

    def __init__(self, url: str, *, size: int) -> None:
        import psycopg

        self._idle: queue.SimpleQueue[psycopg.Connection[Any]] = queue.SimpleQueue()
        for _ in range(size):
            self._idle.put(psycopg.connect(url, autocommit=True))

    @contextmanager
    def lend(self) -> Iterator[psycopg.Connection[Any]]:
        connection = self._idle.get()
        try:
            yield connection
        finally:
            self._idle.put(connection)


def create_app() -> FastAPI:
    """The app, with its connections opened before the first request."""
    from fastapi import FastAPI
    from psycopg.types.json import Jsonb

    connections = Connections(libpq_url(), size=CONNECTIONS)
    app = FastAPI()

    @app.post("/bare", status_code=202)
    def bare(body: dict[str, Any]) -> dict[str, str]:
        row_id = uuid.uuid4()
        with connections.lend() as connection:
            connection.execute(INSERT, (row_id, Jsonb(body)))
        return {"id": str(row_id), "status": "queued"}

    return app
