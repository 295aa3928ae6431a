"""How Ratchet connects to PostgreSQL: every wait on the server bounded (connect, statement,
idle in transaction, keepalives, a client-side limit on a silent server), a connection that
sat idle pinged before use, and a pool that bounds what a process holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DisconnectionError

from shared.settings import Settings, get_settings


def make_engine(url: str, *, pool_size: int | None, max_overflow: int | None) -> Engine:
    settings = get_settings()
    # A step holds a connection only for each of its writes, never while its model or tool
    # works, so a few connections serve every step a process runs at once; the pool bounds
    # what a host holds whatever the number of tasks in flight.
    engine = create_engine(
        url,
        pool_size=settings.db_pool_size if pool_size is None else pool_size,
        max_overflow=settings.db_pool_overflow if max_overflow is None else max_overflow,
        pool_recycle=1800,
        pool_timeout=settings.db_pool_timeout_seconds,
        # Bound parameters are request data (task inputs, metadata): never in errors or logs.
        hide_parameters=True,
        connect_args=_postgres_connect_args(settings),
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
