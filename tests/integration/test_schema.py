"""The migrations build exactly the schema the models describe, on both databases: a model
changed without its migration (or the reverse) fails here, not in production."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from shared.store.db import migrate
from shared.store.tables import Base


def differences(url: str) -> list[Any]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(compare_metadata(MigrationContext.configure(conn), Base.metadata))
    finally:
        engine.dispose()


def test_postgresql_migrations_match_the_models(database_url: str) -> None:
    assert differences(database_url) == []


def test_sqlite_migrations_match_the_models(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'schema.db'}"
    migrate(url)
    # SQLite does not report an index's column order (``priority DESC``): that one index
    # reads as removed and added again.
    left = [d for d in differences(url) if d[1].name != "ix_tasks_backlog"]
    assert left == []
