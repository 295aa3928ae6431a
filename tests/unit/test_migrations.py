"""Migrations run on SQLite (the embedded default) and the app refuses an unmigrated database."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from shared.errors import DatabaseNotMigrated
from shared.store.db import migrate, require_migrated


def test_sqlite_migrates_and_unmigrated_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    engine = create_engine(url)
    with pytest.raises(DatabaseNotMigrated, match="ratchet migrate"):
        require_migrated(engine)
    migrate(url)
    require_migrated(engine)
    tables = set(inspect(engine).get_table_names())
    assert {"tenants", "api_keys", "tasks", "steps", "tool_calls", "task_events"} <= tables
    migrate(url)  # idempotent
    engine.dispose()
