"""A tool step's writes: an idempotent call that runs at once is started by the write of the
model's answer (one write fewer per tool step); any other call gets its own ``started`` write
just before it runs. Either way a crash right after the answer's commit loses nothing and does
nothing twice."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shared.failpoints import InjectedFault
from tests.conftest import TenantHandle
from tests.helpers import scripted_task, tool_turn
from tests.integration.test_durability import (
    expire_lease,
    ledger_rows,
    submit,
)
from workers.steps import runner

pytestmark = pytest.mark.backends("postgresql")


@pytest.fixture
def writes() -> Iterator[list[str]]:
    """The SQL of every step write sent straight through psycopg from here on."""
    from benchmarks.harness.meter import watching_direct_sends

    seen: list[str] = []

    def observe(_connection: Any, sql: str, _values: Any) -> None:
        seen.append(sql)

    with watching_direct_sends(observe):
        yield seen


def _starts(writes: list[str]) -> list[str]:
    """The writes that insert a tool call's row."""
    return [sql for sql in writes if "INSERT INTO tool_calls" in sql]


def test_an_idempotent_call_is_started_by_the_write_of_the_answer(
    client: TestClient, tenant: TenantHandle, writes: list[str], journal: Path
) -> None:
    body = scripted_task([tool_turn("upsert_record", key="a"), {"content": "ok"}], agent="ops")
    task_id = submit(client, tenant, body)

    runner.advance(task_id, 1)

    (start,) = _starts(writes)
    assert "INSERT INTO steps" in start  # the answer's checkpoint, in the same statement
    (row,) = ledger_rows(task_id)
    assert (row.status, row.runs) == ("succeeded", 1)
    assert journal.read_text().splitlines() == [f"upsert {task_id}:1-0"]


def test_a_call_that_is_not_idempotent_is_started_on_its_own_just_before_it_runs(
    client: TestClient, tenant: TenantHandle, writes: list[str], journal: Path
) -> None:
    send = tool_turn("send_email", to="a@example.com", subject="hi")
    task_id = submit(client, tenant, scripted_task([send, {"content": "sent"}], agent="ops"))

    runner.advance(task_id, 1)

    (start,) = _starts(writes)
    assert "INSERT INTO steps" not in start
    (row,) = ledger_rows(task_id)
    assert (row.status, row.runs) == ("succeeded", 1)
    assert journal.read_text().count("email") == 1


@pytest.mark.parametrize(
    ("turn", "line"),
    [
        (tool_turn("upsert_record", key="a"), "upsert {task_id}:1-0"),
        (tool_turn("send_email", to="a@example.com", subject="hi"), "email {task_id}:1-0"),
    ],
    ids=["idempotent", "not-idempotent"],
)
def test_a_crash_right_after_the_answer_runs_the_call_once_when_the_step_resumes(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    failpoint: Callable[[str], None],
    journal: Path,
    turn: dict[str, Any],
    line: str,
) -> None:
    task_id = submit(client, tenant, scripted_task([turn, {"content": "ok"}], agent="ops"))
    failpoint("after_model_commit=raise")
    with pytest.raises(InjectedFault):
        runner.advance(task_id, 1)
    failpoint("")
    assert journal.read_text() == ""  # the call never ran before the crash
    expire_lease(task_id)

    assert drive(task_id) == "succeeded"
    (row,) = ledger_rows(task_id)
    assert row.status == "succeeded"
    assert journal.read_text().splitlines() == [line.format(task_id=task_id)]


def test_the_benchmarks_write_meter_counts_a_tool_steps_commits(
    client: TestClient, tenant: TenantHandle, journal: Path
) -> None:
    """``ratchet bench history`` reports a tool step's commits with this meter (each write
    of a step commits on its own, in autocommit): the lease, the answer with its idempotent
    call's start, and the call's outcome with the step's completion."""
    from benchmarks.harness.meter import WriteMeter
    from shared.store.db import get_engine

    body = scripted_task([tool_turn("upsert_record", key="a"), {"content": "ok"}], agent="ops")
    task_id = submit(client, tenant, body)
    with WriteMeter().watching(get_engine()) as meter, meter.labelled("step"):
        runner.advance(task_id, 1)
    assert meter.commits["step"] == 3
    assert meter.bytes["step"] > 0
