"""Engines, sessions and the database clock."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Engine, create_engine, event, text
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


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # A process stopped in the middle of a transaction (SIGSTOP, a frozen VM) must not keep the
    # rows it locked: Postgres ends such a session after a lease's length, and the lease, the
    # sweeper and everyone else move on.
    idle_ms = int(get_settings().lease_ttl_seconds * 1000)
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=10,
        max_overflow=20,
        pool_recycle=1800,
        connect_args={"options": f"-c idle_in_transaction_session_timeout={idle_ms}"},
    )


_engines: dict[tuple[str, int], Engine] = {}


def get_engine() -> Engine:
    """The process's engine. Keyed on the PID so a forked Celery child never shares sockets."""
    key = (get_settings().effective_database_url, os.getpid())
    engine = _engines.get(key)
    if engine is None:
        engine = _engines.setdefault(key, make_engine(key[0]))
    return engine


def reset_engines() -> None:
    """Forget every engine; this process's own are closed, a parent's are left alone."""
    for (_, pid), engine in list(_engines.items()):
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


@contextmanager
def write_session() -> Iterator[Session]:
    """A session for writes that are each one atomic statement (see shared.batch).

    On PostgreSQL it runs in autocommit: each statement commits on its own, which saves the
    round trips of BEGIN and COMMIT. Elsewhere it is an ordinary transaction, committed at the
    end, in which a batch runs as several statements.
    """
    engine = get_engine()
    if engine.dialect.name != "postgresql":
        with transaction() as session:
            yield session
        return
    with engine.connect() as connection:
        autocommit = connection.execution_options(isolation_level="AUTOCOMMIT")
        with get_sessionmaker()(bind=autocommit) as session:
            yield session


def alembic_config(url: str | None = None) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url or get_settings().effective_database_url)
    return config


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
