"""The one place the kind of database is decided: PostgreSQL in production, SQLite in the
embedded default. Everything that differs between them goes through the backend of the
session's engine: how a write session opens, how a kept statement runs, how a fenced write's
batch runs, and whether this process may sweep.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

from sqlalchemy import ColumnElement, Row
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.orm import Session

from shared.store.backends.postgresql import PostgreSQL
from shared.store.backends.sqlite import SQLite
from shared.store.batch import Batch
from shared.store.db import get_engine


class Backend(Protocol):
    name: str

    def make_engine(
        self, url: str, *, pool_size: int | None, max_overflow: int | None
    ) -> Engine: ...

    def write_session(self, *, heartbeat: bool = False) -> AbstractContextManager[Session]: ...

    def fetch_one(self, session: Session, statement: Any, params: dict[str, Any]) -> Any | None: ...

    def run_batch(self, session: Session, batch: Batch) -> Row[Any] | None: ...

    def try_sweep_lock(self, session: Session, lock_id: int) -> bool: ...

    def epoch_seconds(self, column: Any) -> ColumnElement[float]: ...

    def plan_with_values(self, session: Session) -> None: ...

    def scan_index_entries(self, session: Session) -> None: ...


BACKENDS: dict[str, Backend] = {"postgresql": PostgreSQL(), "sqlite": SQLite()}


def backend_of(bind: Engine | Connection | Session) -> Backend:
    """The backend of an engine, a connection or a session's bind."""
    if isinstance(bind, Session):
        bind = bind.get_bind()
    return BACKENDS[bind.dialect.name]


def for_url(url: str) -> Backend:
    """The backend of a database URL (``postgresql…://`` or ``sqlite:///…``)."""
    return BACKENDS[make_url(url).get_backend_name()]


def current() -> Backend:
    """The backend of the configured database."""
    return backend_of(get_engine())


def write_session(*, heartbeat: bool = False) -> AbstractContextManager[Session]:
    """A session for writes that are each one atomic batch (see ``shared.store.batch``); the
    connection goes back to the pool when the block ends. ``heartbeat``: on the heartbeat's
    own connection (PostgreSQL)."""
    return current().write_session(heartbeat=heartbeat)


def fetch_one(session: Session, statement: Any, params: dict[str, Any]) -> Any | None:
    """Run a statement built once and kept (a module constant, or cached); its one row or
    None."""
    return backend_of(session).fetch_one(session, statement, params)


def run_batch(session: Session, batch: Batch) -> Row[Any] | None:
    """Execute a fenced write's batch; returns the fence's row, or None (nothing written)."""
    return backend_of(session).run_batch(session, batch)


def plan_with_values(session: Session) -> None:
    """For the rest of this transaction, plan each query with its values: a query over a
    time window needs to know how wide the window is (see the PostgreSQL backend)."""
    backend_of(session).plan_with_values(session)


def scan_index_entries(session: Session) -> None:
    """For the rest of this transaction, read indexes entry by entry, never as a bitmap: see
    the PostgreSQL backend."""
    backend_of(session).scan_index_entries(session)
