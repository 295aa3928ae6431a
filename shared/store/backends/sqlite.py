"""SQLite, the embedded default: one process, one writer at a time; a fenced write's batch
runs statement by statement inside an ordinary transaction."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import ColumnElement, Engine, Float, Row, cast, create_engine, event, func
from sqlalchemy.orm import Session

from shared.settings import get_settings
from shared.store.batch import Batch, run_in_turn
from shared.store.db import transaction


class SQLite:
    """The backend of the embedded default: one process, one writer at a time."""

    name = "sqlite"

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

    def try_sweep_lock(self, session: Session, lock_id: int) -> bool:
        return True  # one process sweeps: the embedded default's own

    def plan_with_values(self, session: Session) -> None:
        """SQLite plans every statement with its values."""

    def scan_index_entries(self, session: Session) -> None:
        """SQLite has no bitmap scans."""

    def epoch_seconds(self, column: Any) -> ColumnElement[float]:
        """A timestamp column (stored as UTC text) as seconds since the epoch."""
        return cast(func.strftime("%s", column), Float)


def _pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()
