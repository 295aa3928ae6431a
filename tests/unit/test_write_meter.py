"""The write meter's watch is the benchmarks' own: the step's path carries no hook for it,
and a watch wraps the PostgreSQL backend's direct sender only while it lasts. (That it sees
and counts a step's writes: tests/integration/test_tool_step_writes.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.harness.meter import watching_direct_sends
from shared.store import db
from shared.store.backends import postgresql


def ignore(_connection: Any, _sql: str, _values: Any) -> None:
    pass


def test_the_store_keeps_no_list_of_statement_observers() -> None:
    hooks = [name for name in (*vars(db), *vars(postgresql)) if "observer" in name]
    assert hooks == []


def test_a_watch_wraps_the_direct_sender_only_while_it_lasts() -> None:
    unwatched = postgresql.fetch_compiled
    with watching_direct_sends(ignore):
        wrapped = postgresql.fetch_compiled
        assert wrapped is not unwatched
        with watching_direct_sends(ignore):
            assert postgresql.fetch_compiled is wrapped  # nested watches share one wrapper
        assert postgresql.fetch_compiled is wrapped
    assert postgresql.fetch_compiled is unwatched


def test_a_watch_ended_by_an_error_unwraps_too() -> None:
    unwatched = postgresql.fetch_compiled
    with pytest.raises(LookupError), watching_direct_sends(ignore):
        raise LookupError("the watched code failed")
    assert postgresql.fetch_compiled is unwatched
