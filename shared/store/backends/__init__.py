"""The one place the kind of database is decided: PostgreSQL in production, SQLite in the
embedded default. Everything that differs between them goes through the backend of the
session's engine: how a write session opens, how a kept statement runs, how a fenced write's
batch runs, what serializes writers (locks held till the transaction ends, row locks), how
an upsert and a per-tenant "first few" query are spelled, whether this process may sweep,
and how a missing database is made. Nothing outside this package asks which database it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from sqlalchemy import ColumnElement, Row, Select
from sqlalchemy.dialects.postgresql import Insert as PostgreSQLInsert
from sqlalchemy.dialects.sqlite import Insert as SQLiteInsert
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.orm import Session

from shared.store.backends.postgresql import PostgreSQL
from shared.store.backends.sqlite import SQLite
from shared.store.batch import Batch
from shared.store.db import get_engine

# An INSERT that can say what to do on a conflict (``on_conflict_do_update``): both
# dialects spell it alike, each with its own class.
Upsert = PostgreSQLInsert | SQLiteInsert


class Backend(Protocol):
    name: str
    # Whether a row lock can fence a write that changes nothing of the row (see
    # ``shared.store.step_write``): PostgreSQL's ``FOR NO KEY UPDATE``; SQLite has no row locks.
    locks_rows: bool

    def make_engine(
        self, url: str, *, pool_size: int | None, max_overflow: int | None
    ) -> Engine: ...

    def write_session(self, *, heartbeat: bool = False) -> AbstractContextManager[Session]: ...

    def fetch_one(self, session: Session, statement: Any, params: dict[str, Any]) -> Any | None: ...

    def run_batch(self, session: Session, batch: Batch) -> Row[Any] | None: ...

    def run_batches(self, session: Session, batches: Sequence[Batch]) -> list[Row[Any] | None]: ...

    def try_sweep_lock(self, session: Session, lock_id: int) -> bool: ...

    def epoch_seconds(self, column: Any) -> ColumnElement[float]: ...

    def plan_with_values(self, session: Session) -> None: ...

    def scan_index_entries(self, session: Session) -> None: ...

    def hold_lock(self, session: Session, lock_id: int) -> None: ...

    def hold_tenant_lock(self, session: Session, tenant_id: str, *, namespace: int) -> None: ...

    def commit_each_statement(self, session: Session) -> None: ...

    def upsert(self, table: Any) -> Upsert: ...

    def first_per_tenant(
        self,
        columns: Sequence[Any],
        *,
        where: ColumnElement[bool],
        order: Sequence[Any],
        limit: int,
    ) -> Select[Any]: ...

    def create_database(self, url: URL) -> bool: ...

    def describe(self, url: URL) -> str: ...


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


def run_batches(session: Session, batches: Sequence[Batch]) -> list[Row[Any] | None]:
    """Execute many batches in the caller's transaction, in order, each as ``run_batch``
    would (on PostgreSQL all sent before the first answer is awaited); the fence's row of
    each, or None."""
    return backend_of(session).run_batches(session, batches)


def plan_with_values(session: Session) -> None:
    """For the rest of this transaction, plan each query with its values: a query over a
    time window needs to know how wide the window is (see the PostgreSQL backend)."""
    backend_of(session).plan_with_values(session)


def scan_index_entries(session: Session) -> None:
    """For the rest of this transaction, read indexes entry by entry, never as a bitmap: see
    the PostgreSQL backend."""
    backend_of(session).scan_index_entries(session)


def hold_lock(session: Session, lock_id: int) -> None:
    """Wait for, and hold till the transaction ends, the fleet-wide lock ``lock_id``: one
    holder at a time (PostgreSQL; SQLite has one writer at a time anyway)."""
    backend_of(session).hold_lock(session, lock_id)


def hold_tenant_lock(session: Session, tenant_id: str, *, namespace: int) -> None:
    """Wait for, and hold till the transaction ends, the tenant's lock of ``namespace`` (one
    per kind of row a tenant has a most of): what counts and adds such rows of one tenant
    runs one transaction at a time, other tenants' unhindered."""
    backend_of(session).hold_tenant_lock(session, tenant_id, namespace=namespace)


def commit_each_statement(session: Session) -> None:
    """Run the session's statements each as a transaction of its own, where that saves the
    round trips of BEGIN and COMMIT (PostgreSQL); for a session whose one write is one
    statement. Call it before the session's first statement."""
    backend_of(session).commit_each_statement(session)


def upsert(session: Session, table: Any) -> Upsert:
    """An INSERT into ``table`` that can say what to do on a conflict."""
    return backend_of(session).upsert(table)


def first_per_tenant(
    session: Session,
    columns: Sequence[Any],
    *,
    where: ColumnElement[bool],
    order: Sequence[Any],
    limit: int,
) -> Select[Any]:
    """Each tenant's first ``limit`` tasks meeting ``where``, in ``order``: ``columns`` (of
    the task) and the tenant's ``name``. Nothing says in which order the tenants come."""
    return backend_of(session).first_per_tenant(columns, where=where, order=order, limit=limit)


def describe(url: str) -> str:
    """The database ``url`` names, for a person: its kind and where it is (never a
    password)."""
    return for_url(url).describe(make_url(url))
