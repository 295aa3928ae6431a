"""SQLite, the embedded default: one process, one writer at a time (so no lock is needed to
serialize writers); a fenced write's batch runs statement by statement inside an ordinary
transaction."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Engine,
    Float,
    Row,
    Select,
    cast,
    create_engine,
    event,
    func,
    select,
)
from sqlalchemy.dialects.sqlite import dml as sqlite_dml
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from shared.settings import get_settings
from shared.store.batch import Batch, run_in_turn
from shared.store.db import transaction
from shared.store.tables import Task, Tenant


class SQLite:
    """The backend of the embedded default: one process, one writer at a time."""

    name = "sqlite"
    locks_rows = False

    def make_engine(self, url: str, *, pool_size: int | None, max_overflow: int | None) -> Engine:
        """A file next to the data directory (made if missing); SQLite pools nothing."""
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_timeout=get_settings().db_pool_timeout_seconds,
            hide_parameters=True,
        )
        event.listen(engine, "connect", _pragmas)
        return engine

    @contextmanager
    def write_session(self, *, heartbeat: bool = False) -> Iterator[Session]:
        """An ordinary transaction, committed at the end; a batch runs in it in turn."""
        with transaction() as session:
            yield session

    def fetch_one(self, session: Session, statement: Any, params: dict[str, Any]) -> Any | None:
        return session.execute(statement, params).one_or_none()

    def run_batch(self, session: Session, batch: Batch) -> Row[Any] | None:
        return run_in_turn(session, batch)

    def run_batches(self, session: Session, batches: Sequence[Batch]) -> list[Row[Any] | None]:
        return [run_in_turn(session, batch) for batch in batches]

    def try_sweep_lock(self, session: Session, lock_id: int) -> bool:
        return True  # one process sweeps: the embedded default's own

    def plan_with_values(self, session: Session) -> None:
        """SQLite plans every statement with its values."""

    def scan_index_entries(self, session: Session) -> None:
        """SQLite has no bitmap scans."""

    def epoch_seconds(self, column: Any) -> ColumnElement[float]:
        """A timestamp column (stored as UTC text) as seconds since the epoch."""
        return cast(func.strftime("%s", column), Float)

    def hold_lock(self, session: Session, lock_id: int) -> None:
        """SQLite has one writer at a time: a transaction that writes holds every lock."""

    def hold_tenant_lock(self, session: Session, tenant_id: str, *, namespace: int) -> None:
        """SQLite has one writer at a time: a transaction that writes holds every lock."""

    def commit_each_statement(self, session: Session) -> None:
        """SQLite's transactions cost no round trip: the session's own is kept."""

    def upsert(self, table: Any) -> sqlite_dml.Insert:
        return sqlite_dml.insert(table)

    def first_per_tenant(
        self,
        columns: Sequence[Any],
        *,
        where: ColumnElement[bool],
        order: Sequence[Any],
        limit: int,
    ) -> Select[Any]:
        """The matching tasks ranked within their tenant (a window), the first ``limit`` of
        each kept: SQLite has no LATERAL."""
        rank = func.row_number().over(partition_by=Task.tenant_id, order_by=order)
        ranked = (
            select(*columns, Tenant.name, rank.label("rank"))
            .join(Tenant, Tenant.id == Task.tenant_id)
            .where(where)
            .subquery()
        )
        return select(*[c for c in ranked.c if c.name != "rank"]).where(ranked.c.rank <= limit)

    def create_database(self, url: URL) -> bool:
        """A SQLite file is made by connecting to it: there is nothing to create first."""
        return False

    def describe(self, url: URL) -> str:
        return f"SQLite {url.database}"


def _pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()
