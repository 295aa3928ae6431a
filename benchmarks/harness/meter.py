"""The write meter, and the statement watch it counts with: every statement Ratchet sends to
PostgreSQL, seen before it is sent.

Ratchet sends its statements two ways. SQLAlchemy's go through the engine, whose
``before_cursor_execute`` event shows them. The step's own go straight through psycopg, past
that event: the PostgreSQL backend compiles them once and sends them in
:func:`shared.store.backends.postgresql.fetch_compiled`. A watch wraps that one function for
as long as it lasts, and puts it back after: when nothing is watched, nothing of the meter is
on the step's path.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

# Called as (connection, sql, parameters) before a statement is sent: the SQLAlchemy
# connection, the statement as the driver gets it, and its parameters (psycopg's Jsonb
# wrappers included, for those the backend sends itself).
Observer = Callable[[Connection, str, Any], None]

_observers: list[Observer] = []
_unwatched: dict[str, Callable[..., Any]] = {}  # the backend's own function, while wrapped
_lock = threading.Lock()
_sending = threading.local()  # the SQLAlchemy connection of the statement being sent


class _WatchedCursor(psycopg.Cursor[Any]):
    """A cursor that shows its statement to the observers before sending it."""

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        for observe in list(_observers):
            observe(_sending.connection, str(query), params)
        return super().execute(query, params, **kwargs)


def _watched(send: Callable[..., Any]) -> Callable[..., Any]:
    """``send`` (the backend's ``fetch_compiled``), its cursor shown to the observers."""

    def fetch_compiled(session: Session, statement: Any, params: dict[str, Any]) -> Any:
        # The connection ``send`` will use, found as it finds it: taken first, so a pool
        # checkout's ping is not among the statements watched.
        bind = session.bind
        connection = bind if isinstance(bind, Connection) else session.connection()
        driver = connection.connection.driver_connection
        assert isinstance(driver, psycopg.Connection)
        previous = driver.cursor_factory
        driver.cursor_factory = _WatchedCursor
        _sending.connection = connection
        try:
            return send(session, statement, params)
        finally:
            driver.cursor_factory = previous
            _sending.connection = None

    return fetch_compiled


@contextmanager
def watching_direct_sends(observe: Observer) -> Iterator[None]:
    """``observe`` sees each statement the PostgreSQL backend sends straight through psycopg,
    in any thread, until the block ends. Watches nest; the last one out unwraps."""
    from shared.store.backends import postgresql

    with _lock:
        if not _observers:
            _unwatched["fetch_compiled"] = send = postgresql.fetch_compiled
            postgresql.fetch_compiled = _watched(send)
        _observers.append(observe)
    try:
        yield
    finally:
        with _lock:
            _observers.remove(observe)
            if not _observers:
                postgresql.fetch_compiled = _unwatched.pop("fetch_compiled")


@contextmanager
def watching_statements(engine: Engine, observe: Observer) -> Iterator[None]:
    """``observe`` sees every statement sent to PostgreSQL until the block ends: those
    ``engine`` sends through SQLAlchemy and those the backend sends itself."""

    def before(connection: Connection, _cursor: Any, sql: str, params: Any, *_: Any) -> None:
        observe(connection, sql, params)

    event.listen(engine, "before_cursor_execute", before)
    try:
        with watching_direct_sends(observe):
            yield
    finally:
        event.remove(engine, "before_cursor_execute", before)


def _unwrapped(value: Any) -> Any:
    return getattr(value, "obj", None) if hasattr(value, "obj") else str(value)


@dataclass
class WriteMeter:
    """Counts write transactions and the bytes of written parameters, per label."""

    label: str = ""
    commits: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _dirty: set[int] = field(default_factory=set)

    @contextmanager
    def watching(self, engine: Engine) -> Iterator[WriteMeter]:
        """Count every write sent to PostgreSQL until the block ends: a write statement in
        autocommit is a commit of its own; others count at their transaction's commit
        through ``engine``."""

        def commit(connection: Connection) -> None:
            if id(connection) in self._dirty:
                self._dirty.discard(id(connection))
                self.commits[self.label] += 1

        def rollback(connection: Connection) -> None:
            self._dirty.discard(id(connection))

        event.listen(engine, "commit", commit)
        event.listen(engine, "rollback", rollback)
        try:
            with watching_statements(engine, self.observe):
                yield self
        finally:
            event.remove(engine, "commit", commit)
            event.remove(engine, "rollback", rollback)

    def observe(self, connection: Connection, statement: str, params: Any) -> None:
        """Count ``statement`` if it writes."""
        words = statement.lstrip().upper()
        if not words.startswith(("INSERT", "UPDATE", "DELETE")) and not (
            words.startswith("WITH") and any(v in words for v in ("INSERT", "UPDATE"))
        ):
            return
        # psycopg's Jsonb wrapper prints abbreviated: measure what it wraps
        self.bytes[self.label] += len(json.dumps(params, default=_unwrapped))
        if _autocommit(connection):
            self.commits[self.label] += 1  # a write statement in autocommit commits alone
        else:
            self._dirty.add(id(connection))

    @contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        self.label = label
        try:
            yield
        finally:
            self.label = ""


def _autocommit(connection: Connection) -> bool:
    """Whether a statement on ``connection`` commits on its own: in SQLAlchemy's autocommit,
    or on a driver connection switched to it (a write session's)."""
    if connection.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
        return True
    return getattr(connection.connection.driver_connection, "autocommit", False) is True
