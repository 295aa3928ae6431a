"""SQLite, the embedded default: one process, one writer at a time; a fenced write's batch
runs statement by statement inside an ordinary transaction."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Row
from sqlalchemy.orm import Session

from shared.store.batch import Batch, run_in_turn
from shared.store.db import transaction


class SQLite:
    """The backend of the embedded default: one process, one writer at a time."""

    name = "sqlite"

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
