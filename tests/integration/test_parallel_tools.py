"""The tool calls of one model answer run at once (workers.steps.fan_out), at most
``RATCHET_TOOL_CONCURRENCY`` at a time, each through the ledger as a call that runs alone: its
outcome committed as it finishes, the step completed once when all are settled, the model's
next turn reading every outcome in the order it asked for them. A cancel, an unknown outcome
that fails the task and one that asks a person each end the step once.

Concurrency is proven without timings: each ``meet`` call (tests.sample_agents) waits until
its group's ``parties`` calls run together, so calls that all return ok ran at once.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from shared.store import checkpoints
from shared.store.db import transaction
from shared.store.tables import TaskEvent
from tests.conftest import Configure, TenantHandle
from tests.helpers import scripted_task
from tests.integration.test_durability import ledger_rows, submit, task_row
from workers.steps import runner
from workers.steps.context import step_messages

pytestmark = pytest.mark.backends("postgresql", "sqlite")

LIMIT = 30.0  # seconds: how long anything here may take before the test fails, not hangs


def calls_turn(*calls: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    """One model answer asking for ``calls`` at once."""
    return {"tool_calls": [{"name": name, "arguments": args} for name, args in calls]}


def meeting(group: str) -> Any:
    """What the ``meet`` calls of ``group`` saw (the module loads with the registry, as the
    extension it is)."""
    from tests import sample_agents

    return sample_agents.meeting(group)


def logged_events(task_id: str) -> list[tuple[str, dict[str, Any]]]:
    with transaction() as session:
        rows = session.scalars(
            select(TaskEvent).where(TaskEvent.task_id == task_id).order_by(TaskEvent.seq)
        ).all()
        return [(row.type, row.data) for row in rows]


def test_the_calls_of_one_answer_run_at_once_and_are_read_back_in_order(
    client: TestClient, tenant: TenantHandle
) -> None:
    group = uuid.uuid4().hex
    meet = [("meet", {"group": group, "parties": 3}) for _ in range(3)]
    body = scripted_task([calls_turn(*meet), {"content": "all met"}], agent="crew")
    task_id = submit(client, tenant, body)

    carried = runner.advance_one(task_id, 1, go_on=lambda: True)
    assert carried is not None
    assert carried.lease is not None  # the completion leased the next step
    runner.advance_one(task_id, 2, carried=carried)

    seen = meeting(group).seen
    assert [kind for kind, _ in seen] == ["start"] * 3 + ["end"] * 3  # all ran at once
    task = task_row(task_id)
    assert (task.status, task.steps) == ("succeeded", 2)

    # The timeline: the three outcomes, in the order the model asked for them.
    steps = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()["items"]
    first = steps[0]["tool_calls"]
    assert [c["call_id"] for c in first] == [f"1-{p}" for p in range(3)]
    assert [(c["status"], c["result"]) for c in first] == [("succeeded", f"met in {group}")] * 3
    assert [(c.status, c.runs) for c in ledger_rows(task_id)] == [("succeeded", 1)] * 3

    # Each outcome committed as it finished, the step completed once, after all of them.
    events = logged_events(task_id)
    first_step = [(kind, data) for kind, data in events if data.get("step") == 1]
    kinds = [kind for kind, _ in first_step]
    assert kinds == ["step.model_response"] + ["step.tool_call"] * 3 + ["step.completed"]
    completed = [data["step"] for kind, data in events if kind == "step.completed"]
    assert completed == [1, 2]  # each step once (the answer completes the second)

    # The next turn read every result, in order: as carried in memory to the step after it,
    # and as a fresh lease rebuilds it from the rows.
    said = carried.history[-4:]
    assert said[0]["role"] == "assistant"
    assert [m["tool_call_id"] for m in said[1:]] == [f"call_1_{p}" for p in range(3)]
    assert [m["content"] for m in said[1:]] == [f"met in {group}"] * 3
    with transaction() as session:
        rows, calls = checkpoints.load_history(session, task_id)
        rebuilt = step_messages([rows[0]], calls)
    assert rebuilt == said


def test_no_more_than_tool_concurrency_calls_run_at_once(
    client: TestClient, tenant: TenantHandle, configure: Configure, drive: Callable[..., str]
) -> None:
    configure(RATCHET_TOOL_CONCURRENCY="2")
    group = uuid.uuid4().hex
    # Each pair meets, then holds on a moment: a third call running meanwhile would be counted.
    meet = [("meet", {"group": group, "parties": 2, "hold": 0.3}) for _ in range(4)]
    task_id = submit(client, tenant, scripted_task([calls_turn(*meet)], agent="crew"))

    assert drive(task_id) == "succeeded"

    found = meeting(group)
    assert found.peak == 2
    assert [kind for kind, _ in found.seen].count("end") == 4
    assert [(c.status, c.runs) for c in ledger_rows(task_id)] == [("succeeded", 1)] * 4


def test_a_cancel_while_the_calls_run_ends_the_task_once(
    client: TestClient,
    tenant: TenantHandle,
    configure: Configure,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Short leases: were the cancel's wake-up lost, the heartbeat would see it within 0.3 s.
    configure(RATCHET_LEASE_TTL_SECONDS="0.9")
    sleeps = [("sleep", {"seconds": 120}) for _ in range(3)]
    task_id = submit(client, tenant, scripted_task([calls_turn(*sleeps)], agent="crew"))
    step = threading.Thread(target=runner.advance, args=(task_id, 1), daemon=True)
    with caplog.at_level(logging.INFO, logger="ratchet.step"):
        step.start()
        wait_until(lambda: len(ledger_rows(task_id)) == 3)  # all three started
        response = client.post(f"/v1/tasks/{task_id}/cancel", headers=tenant.headers)
        assert response.status_code == 202, response.text
        step.join(LIMIT)
    assert not step.is_alive()  # the step stopped waiting for sleeps of two minutes

    task = task_row(task_id)
    assert (task.status, task.error["type"]) == ("cancelled", "cancelled")  # type: ignore[index]
    kinds = [kind for kind, _ in logged_events(task_id)]
    assert kinds.count("task.cancelled") == 1
    assert "step.completed" not in kinds
    ended = [r.getMessage() for r in caplog.records if r.name == "ratchet.step"]
    assert len([line for line in ended if line.startswith("step 1 ")]) == 1, ended
    assert "ended" in ended[-1], ended
    # The call whose wait ended first is written off in the cancel's write; the others' outcomes
    # are not written after the task ended.
    statuses = sorted(c.status for c in ledger_rows(task_id))
    assert "succeeded" not in statuses, statuses
    assert statuses.count("failed") == 1, statuses


def test_an_unknown_outcome_that_fails_the_task_stops_the_step(
    client: TestClient, tenant: TenantHandle, journal: Path, drive: Callable[..., str]
) -> None:
    # slow_send overruns its 0.2 s limit; it is not idempotent and its policy fails the task.
    calls = [("slow_send", {"seconds": 2}), ("upsert_slowly", {"key": "a", "seconds": 0.5})]
    calls.append(("upsert_record", {"key": "b"}))
    task_id = submit(client, tenant, scripted_task([calls_turn(*calls)], agent="crew"))

    assert drive(task_id) == "failed"

    task = task_row(task_id)
    assert task.error["type"] == "tool_outcome_unknown", task.error  # type: ignore[index]
    kinds = [kind for kind, _ in logged_events(task_id)]
    assert kinds.count("task.failed") == 1
    assert kinds[-1] == "task.failed"
    assert "step.completed" not in kinds
    rows = {row.tool: row for row in ledger_rows(task_id)}
    assert rows["slow_send"].status == "failed"
    assert rows["upsert_record"].status in ("succeeded", "started")  # committed, or dropped
    assert all(row.runs == 1 for row in rows.values())


def test_a_call_that_asks_to_run_again_waits_with_the_others_committed(
    client: TestClient, tenant: TenantHandle, journal: Path, drive: Callable[..., str]
) -> None:
    # slow_ship overruns its 0.2 s limit; its policy asks a person whether to ship again.
    calls = [("upsert_record", {"key": "a"}), ("slow_ship", {"seconds": 1})]
    calls.append(("upsert_record", {"key": "b"}))
    task_id = submit(client, tenant, scripted_task([calls_turn(*calls)], agent="crew"))

    assert drive(task_id) == "awaiting_approval"

    task = task_row(task_id)
    [pending] = task.pending_approval["calls"]  # type: ignore[index]
    assert (pending["call_id"], pending["tool"]) == ("1-1", "slow_ship")
    assert "run it again" in pending["question"]
    rows = ledger_rows(task_id)
    assert {(r.call_id, r.status) for r in rows} == {
        ("1-0", "succeeded"),
        ("1-1", "awaiting"),
        ("1-2", "succeeded"),
    }
    kinds = [kind for kind, _ in logged_events(task_id)]
    assert kinds.count("step.tool_call") == 2
    assert kinds[-1] == "task.awaiting_approval"


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + LIMIT
    while not condition():
        assert time.monotonic() < deadline, f"not so within {LIMIT:g} s"
        time.sleep(0.02)
