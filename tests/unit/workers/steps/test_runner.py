"""Which of a step's own errors are worth another try: one is transient when the database or
Redis is out of reach, and otherwise fails the task with a message a client may read."""

from __future__ import annotations

from typing import cast

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.exceptions import ChildDeadlockedError
from redis.exceptions import ConnectionError as RedisConnectionError
from sqlalchemy.exc import (
    DataError,
    DBAPIError,
    DisconnectionError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    ProgrammingError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeout

from shared.failpoints import InjectedFault
from shared.ratelimit.buckets import LimiterUnavailable
from workers.steps.context import Context
from workers.steps.runner import describe, give_up_or_fail, session_ended, transient


class DriverError(Exception):
    """A database driver's error, with the SQLSTATE it carries."""

    def __init__(self, message: str = "", sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def db_error(
    kind: type[DBAPIError] = DBAPIError,
    sqlstate: str | None = None,
    *,
    invalidated: bool = False,
    message: str = "it went wrong",
) -> DBAPIError:
    return kind(
        "UPDATE tasks SET secret = %(b_secret)s",
        {"b_secret": "hunter2"},
        DriverError(message, sqlstate),
        connection_invalidated=invalidated,
    )


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (db_error(OperationalError, "53300"), True),  # too many connections
        (db_error(InterfaceError), True),
        (db_error(ProgrammingError, "57P01"), True),  # admin shutdown: the session ended
        (db_error(DataError, "08006"), True),  # connection failure
        (db_error(IntegrityError, "23505"), False),  # a unique violation: the same next time
        (db_error(DBAPIError, invalidated=True), True),
        (RedisConnectionError("down"), True),
        (TimeoutError(), True),
        # Every connection of the pool busy past its wait (a busy process, not a bad step).
        (PoolTimeout("QueuePool limit of size 6 overflow 1 reached"), True),
        (DisconnectionError("connection was invalidated"), True),
        (OSError("no route to host"), True),
        (LimiterUnavailable("redis is away"), True),
        (ChildDeadlockedError(), True),  # a Redis pool locked across a fork
        (ValueError("bad value"), False),
        (AssertionError(), False),
    ],
)
def test_only_errors_another_try_may_escape_are_transient(exc: Exception, expected: bool) -> None:
    assert transient(exc) is expected


@pytest.mark.parametrize(
    ("sqlstate", "invalidated", "ended"),
    [
        ("25P03", False, True),  # idle in transaction too long
        ("08003", False, True),
        ("57P01", False, True),
        ("40001", False, False),  # a serialization failure is a statement's, not the session's
        ("23505", False, False),
        (None, False, False),
        (None, True, True),
    ],
)
def test_the_session_ended_when_the_database_dropped_it_not_when_it_refused_a_statement(
    sqlstate: str | None, invalidated: bool, ended: bool
) -> None:
    assert session_ended(db_error(sqlstate=sqlstate, invalidated=invalidated)) is ended


def test_a_database_error_is_described_by_the_driver_error_without_sql_or_parameters() -> None:
    text = describe(db_error(IntegrityError, "23505", message="duplicate key\nDETAIL: (id)=(1)"))
    assert text == "DriverError: duplicate key"
    assert "UPDATE" not in text
    assert "hunter2" not in text


@given(message=st.text(max_size=2000))
def test_a_description_is_one_line_of_at_most_500_characters(message: str) -> None:
    text = describe(RuntimeError(message))
    assert text.startswith("RuntimeError: ")
    assert len(text) <= 500
    assert len(text.splitlines()) == 1


@pytest.mark.parametrize(
    "exc",
    [db_error(OperationalError, "08006"), OSError("unreachable"), InjectedFault("crash here")],
)
def test_a_transient_error_or_an_injected_crash_is_raised_for_the_step_to_run_again(
    exc: Exception,
) -> None:
    # None of these fails the task, so the step context is never read.
    with pytest.raises(type(exc)) as raised:
        give_up_or_fail(cast(Context, None), exc)
    assert raised.value is exc
