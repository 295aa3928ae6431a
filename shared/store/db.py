"""Engines, sessions and the database clock."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    create_engine,
    event,
    text,
)
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql.expression import FunctionElement

from shared.errors import DatabaseNotMigrated
from shared.settings import Settings, get_settings

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


def make_engine(
    url: str, *, pool_size: int | None = None, max_overflow: int | None = None
) -> Engine:
    settings = get_settings()
    # Bound parameters are request data (task inputs, metadata): errors and logs never show them.
    options: dict[str, Any] = {
        "hide_parameters": True,
        "pool_timeout": settings.db_pool_timeout_seconds,
    }
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, **options
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # A step holds a connection only for each of its writes, never while its model or tool
    # works, so a few connections serve every step a process runs at once; the pool bounds
    # what a host holds whatever the number of tasks in flight.
    engine = create_engine(
        url,
        pool_size=settings.db_pool_size if pool_size is None else pool_size,
        max_overflow=settings.db_pool_overflow if max_overflow is None else max_overflow,
        pool_recycle=1800,
        connect_args=_postgres_connect_args(settings),
        **options,
    )
    event.listen(engine, "do_connect", _bounded_connect(settings.db_statement_timeout_seconds))
    event.listen(engine.pool, "checkout", _ping_on_checkout(engine))
    event.listen(engine.pool, "checkin", _note_checkin)
    return engine


def _postgres_connect_args(settings: Settings) -> dict[str, Any]:
    """libpq parameters: every wait on the server is bounded."""
    # A process stopped in the middle of a transaction (SIGSTOP, a frozen VM) must not keep the
    # rows it locked: Postgres ends such a session after a lease's length, and the lease, the
    # sweeper and everyone else move on.
    idle_seconds = settings.db_idle_in_transaction_timeout_seconds or settings.lease_ttl_seconds
    keepalive = settings.db_keepalive_seconds
    interval, count = max(1, keepalive // 3), 3
    return {
        "connect_timeout": settings.db_connect_timeout_seconds,
        "options": f"-c statement_timeout={int(settings.db_statement_timeout_seconds * 1000)}"
        f" -c idle_in_transaction_session_timeout={int(idle_seconds * 1000)}"
        # Ratchet's queries are keyed lookups or index range scans whose best plan does
        # not depend on the values; re-planning the step's big write statements (a custom
        # plan each time) costs more than running them.
        " -c plan_cache_mode=force_generic_plan",
        "keepalives": 1,
        "keepalives_idle": keepalive,
        "keepalives_interval": interval,
        "keepalives_count": count,
        # Data the server never acknowledges fails the connection as soon as keepalives would.
        "tcp_user_timeout": (keepalive + interval * count) * 1000,
    }


# The client waits this much longer than the server's statement timeout: the server's own
# cancel normally comes first, with its clearer error.
WAIT_GRACE_SECONDS = 5.0


class BoundedConnection(psycopg.Connection[Any]):
    """A psycopg connection that stops waiting for a server that stopped answering.

    ``statement_timeout`` ends a slow statement on the server; nothing on the server ends a
    wait for a server that is unreachable mid-statement (a partition, a hung proxy), and TCP
    may take minutes to notice. So each wait is bounded here too; a connection that gave up
    is closed, as it is mid-protocol, and the pool replaces it.
    """

    wait_limit: float = 0.0  # seconds; 0: unbounded

    def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:
        if self.wait_limit:
            gen = self._bounded(gen, time.monotonic() + self.wait_limit)
        return super().wait(gen, *args, **kwargs)

    def _bounded(self, gen: Any, deadline: float) -> Any:
        """``gen``, given up on once it is still waiting past ``deadline``.

        The waiter wakes the generator with a falsy ready state every tenth of a second
        while the socket is quiet, which is when the deadline is checked."""
        try:
            waiting = next(gen)
            while True:
                ready = yield waiting
                if not ready and time.monotonic() > deadline:
                    self.pgconn.finish()
                    raise psycopg.OperationalError(
                        f"the database did not answer within {self.wait_limit:g} s"
                    )
                waiting = gen.send(ready)
        except StopIteration as stop:
            return stop.value


def _bounded_connect(statement_timeout: float) -> Callable[..., BoundedConnection]:
    def connect(_dialect: Any, _record: Any, cargs: Any, cparams: Any) -> BoundedConnection:
        connection = BoundedConnection.connect(*cargs, **cparams)
        if statement_timeout:
            connection.wait_limit = statement_timeout + WAIT_GRACE_SECONDS
        return connection

    return connect


# A connection back in the pool for less than this is handed out again without a ping: it
# was working a moment ago, and a step's writes come a few milliseconds apart. One idle for
# longer (across a long model call, say) is pinged first, as SQLAlchemy's pre-ping would.
PING_IDLE_SECONDS = 1.0
_CHECKED_IN_AT = "ratchet_checked_in_at"


def _note_checkin(_dbapi_connection: Any, record: Any) -> None:
    record.info[_CHECKED_IN_AT] = time.monotonic()


def _ping_on_checkout(engine: Engine) -> Any:
    """The pool's pessimistic disconnect check, for connections that sat idle."""

    def ping(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        checked_in = record.info.get(_CHECKED_IN_AT)
        if checked_in is not None and time.monotonic() - checked_in < PING_IDLE_SECONDS:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as exc:
            # The pool throws this connection away and hands out another.
            raise DisconnectionError("connection failed its ping") from exc

    return ping


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


# Called as (connection, sql, parameters) before the PostgreSQL backend sends a statement itself, as
# SQLAlchemy's before_cursor_execute is for the statements it sends (the checkpoint benchmark
# counts writes with both).
statement_observers: list[Callable[[Connection, str, dict[str, Any]], None]] = []


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
