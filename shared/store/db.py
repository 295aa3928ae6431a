"""Engines, sessions and the database clock."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    Engine,
    text,
)
from sqlalchemy.engine import make_url
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql.expression import FunctionElement

from shared.errors import DatabaseNotMigrated
from shared.settings import get_settings

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


class now_ms(FunctionElement[int]):  # noqa: N801 - reads like the SQL function it stands for
    """The database server's clock in epoch milliseconds: the only clock leases trust."""

    type = BigInteger()
    inherit_cache = True


@compiles(now_ms, "postgresql")
def _now_ms_postgresql(element: now_ms, compiler: Any, **kw: Any) -> str:
    return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)"


@compiles(now_ms, "sqlite")
def _now_ms_sqlite(element: now_ms, compiler: Any, **kw: Any) -> str:
    return "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"


def make_engine(
    url: str, *, pool_size: int | None = None, max_overflow: int | None = None
) -> Engine:
    """An engine for ``url``, made by the backend of its kind of database."""
    from shared.store.backends import for_url  # the backends build on this module

    return for_url(url).make_engine(url, pool_size=pool_size, max_overflow=max_overflow)


_engines: dict[tuple[str, int, bool], Engine] = {}


def get_engine(*, heartbeat: bool = False) -> Engine:
    """The process's engine. Keyed on the PID so a forked Celery child never shares sockets.

    ``heartbeat``: the lease heartbeat's own engine, one connection: the heartbeat must never
    queue for a connection behind the hundreds of steps a process may be writing for, or the
    leases it keeps could run out while it waits.
    """
    key = (get_settings().effective_database_url, os.getpid(), heartbeat)
    engine = _engines.get(key)
    if engine is None:
        sizes = {"pool_size": 1, "max_overflow": 0} if heartbeat else {}
        engine = _engines.setdefault(key, make_engine(key[0], **sizes))
    return engine


def reset_engines() -> None:
    """Forget every engine; this process's own are closed, a parent's are left alone."""
    for (_, pid, _), engine in list(_engines.items()):
        engine.dispose(close=pid == os.getpid())
    _engines.clear()
    _sessionmakers.clear()


_sessionmakers: dict[int, sessionmaker[Session]] = {}


def get_sessionmaker() -> sessionmaker[Session]:
    """One sessionmaker per engine: making one builds a Session subclass, which is costly."""
    engine = get_engine()
    maker = _sessionmakers.get(id(engine))
    if maker is None or maker.kw.get("bind") is not engine:
        maker = _sessionmakers[id(engine)] = sessionmaker(bind=engine, expire_on_commit=False)
    return maker


@contextmanager
def transaction() -> Iterator[Session]:
    """A session inside one transaction: commits on success, rolls back on error."""
    with get_sessionmaker()() as session, session.begin():
        yield session


def alembic_config(url: str | None = None) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url or get_settings().effective_database_url)
    return config


def create_missing_database(url: str) -> bool:
    """Create the database ``url`` names when its server has none of that name; True if it
    did. Only when ``url`` cannot be connected to is the backend asked (PostgreSQL: through
    the server's maintenance database): a database that exists is never touched, and a user
    who may reach only its own database migrates as before. A SQLite file is made by
    connecting.
    """
    from sqlalchemy.exc import OperationalError

    from shared.store.backends import for_url  # the backends build on this module

    engine = make_engine(url, pool_size=1, max_overflow=0)
    try:
        with engine.connect():
            return False
    except OperationalError as refused:
        try:
            created = for_url(url).create_database(make_url(url))
        except OperationalError:
            raise refused from None  # no way in to create it: the first refusal says why
        if not created:
            raise  # it exists (or cannot be made): it failed for another reason, which this says
    finally:
        engine.dispose()
    return True


def migrate(url: str | None = None) -> None:
    """Bring the schema to the newest revision."""
    from alembic import command

    command.upgrade(alembic_config(url), "head")


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        try:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except Exception:
            return None


def require_migrated(engine: Engine | None = None) -> None:
    """Refuse to run against a database whose schema is not at the code's revision."""
    engine = engine or get_engine()
    current, head = current_revision(engine), head_revision()
    if current != head:
        raise DatabaseNotMigrated(
            f"database {engine.url.render_as_string(hide_password=True)} is at revision "
            f"{current or 'none'}, the code needs {head}: run `ratchet migrate`"
        )
