"""DESIGN §5 in one process: leases and fencing, resume points, the ledger's policies, limits.

Steps run inline (``advance``) on each backend, PostgreSQL and SQLite; crashes are injected with
failpoints set to ``raise``, which leaves the database exactly as a kill at that point would.
The tests that kill real worker processes live in tests/e2e.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from shared.errors import LeaseLost
from shared.failpoints import InjectedFault
from shared.settings import get_settings
from shared.store import leases, step_write, tasks
from shared.store.backends import write_session
from shared.store.db import now_ms, transaction
from shared.store.tables import Step, Task, TaskEvent, ToolCall
from tests.conftest import Configure, TenantHandle
from tests.helpers import admit, calculator_script, scripted_task, tool_turn
from workers.providers.scripted import ScriptedProvider
from workers.steps import runner
from workers.steps.context import load_context

pytestmark = pytest.mark.backends("postgresql", "sqlite")


@pytest.fixture
def model_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[str, int]]:
    """Counts every scripted model call per (task, step)."""
    calls: Counter[tuple[str, int]] = Counter()
    original = ScriptedProvider.complete

    def counting(self: ScriptedProvider, request: Any) -> Any:
        calls[(request.task_id, request.step)] += 1
        return original(self, request)

    monkeypatch.setattr(ScriptedProvider, "complete", counting)
    return calls


def submit(client: TestClient, tenant: TenantHandle, body: dict[str, Any]) -> str:
    response = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def task_row(task_id: str) -> Task:
    with transaction() as session:
        task = session.get(Task, task_id)
        assert task is not None
        session.expunge(task)
        return task


def expire_lease(task_id: str) -> None:
    """What time does to a dead worker's lease."""
    with transaction() as session:
        session.execute(update(Task).where(Task.id == task_id).values(lease_expires_ms=0))


def events(task_id: str) -> list[str]:
    with transaction() as session:
        rows = session.scalars(
            select(TaskEvent).where(TaskEvent.task_id == task_id).order_by(TaskEvent.seq)
        ).all()
        assert [e.seq for e in rows] == list(range(1, len(rows) + 1))
        return [e.type for e in rows]


def ledger_rows(task_id: str) -> list[ToolCall]:
    with transaction() as session:
        rows = list(session.scalars(select(ToolCall).where(ToolCall.task_id == task_id)).all())
        session.expunge_all()
        return rows


def test_crash_after_model_commit_never_asks_the_model_again(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    failpoint: Callable[[str], None],
    model_calls: Counter[tuple[str, int]],
) -> None:
    task_id = submit(client, tenant, scripted_task(calculator_script(3)))
    failpoint("after_model_commit=raise")
    with pytest.raises(InjectedFault):
        runner.advance(task_id, 1)
    failpoint("")
    expire_lease(task_id)

    assert drive(task_id) == "succeeded"
    assert model_calls[(task_id, 1)] == 1
    assert set(model_calls.values()) == {1}
    assert task_row(task_id).steps == 3


def test_crash_after_tool_reruns_an_idempotent_tool_with_the_same_key(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    failpoint: Callable[[str], None],
    journal: Path,
) -> None:
    body = scripted_task([tool_turn("upsert_record", key="a"), {"content": "ok"}], agent="ops")
    task_id = submit(client, tenant, body)
    failpoint("after_tool=raise")
    with pytest.raises(InjectedFault):
        runner.advance(task_id, 1)
    failpoint("")
    expire_lease(task_id)

    assert drive(task_id) == "succeeded"
    (row,) = ledger_rows(task_id)
    assert (row.status, row.runs) == ("succeeded", 2)
    assert journal.read_text().splitlines() == [f"upsert {task_id}:1-0"] * 2


def test_crash_mid_call_of_a_non_idempotent_tool_fails_the_task_naming_the_call(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    failpoint: Callable[[str], None],
    journal: Path,
) -> None:
    body = scripted_task(
        [tool_turn("send_email", to="a@example.com", subject="hi"), {"content": "sent"}],
        agent="ops",
    )
    task_id = submit(client, tenant, body)
    failpoint("after_tool=raise")
    with pytest.raises(InjectedFault):
        runner.advance(task_id, 1)
    failpoint("")
    expire_lease(task_id)

    assert drive(task_id) == "failed"
    task = task_row(task_id)
    assert task.error is not None
    assert task.error["type"] == "tool_outcome_unknown"
    assert "1-0 (send_email)" in task.error["message"]
    assert journal.read_text().count("email") == 1  # never sent twice
    (row,) = ledger_rows(task_id)
    assert (row.status, row.runs) == ("failed", 1)


def test_tell_model_policy_reports_unknown_outcome_and_continues(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    failpoint: Callable[[str], None],
    journal: Path,
) -> None:
    body = scripted_task([tool_turn("charge_card", amount_cents=500)], agent="ops")
    task_id = submit(client, tenant, body)
    failpoint("after_tool=raise")
    with pytest.raises(InjectedFault):
        runner.advance(task_id, 1)
    failpoint("")
    expire_lease(task_id)

    assert drive(task_id) == "succeeded"
    task = task_row(task_id)
    assert task.result is not None
    # Past the script's end the model answers with the last tool result: the unknown outcome.
    assert "outcome is unknown" in task.result["output"]
    assert journal.read_text().count("charge") == 1


def test_duplicate_delivery_runs_the_step_once(
    client: TestClient,
    tenant: TenantHandle,
    model_calls: Counter[tuple[str, int]],
) -> None:
    script = [{"delay_ms": 300, **tool_turn("calculator", expression="1+1")}, {"content": "2"}]
    task_id = submit(client, tenant, scripted_task(script))
    barrier = threading.Barrier(2)

    def deliver() -> None:
        barrier.wait()
        runner.advance(task_id, 1)

    threads = [threading.Thread(target=deliver) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert model_calls[(task_id, 1)] == 1
    assert task_row(task_id).steps == 1
    assert len(ledger_rows(task_id)) == 1
    assert events(task_id) == [
        "task.queued",
        "task.started",
        "step.model_response",
        "step.tool_call",
        "step.completed",
    ]


def test_a_worker_that_lost_its_lease_writes_nothing(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    task_id = submit(client, tenant, scripted_task(calculator_script(2)))
    with transaction() as session:
        old = leases.take_lease(
            session, task_id, owner="old", ttl_ms=30_000, step=1, max_attempts=5
        )
    assert isinstance(old, leases.Lease)
    expire_lease(task_id)  # the old worker stalls past its lease …
    with transaction() as session:
        new = leases.take_lease(
            session, task_id, owner="new", ttl_ms=30_000, step=1, max_attempts=5
        )
    assert isinstance(new, leases.Lease)
    assert new.epoch == old.epoch + 1

    with transaction() as session:
        stale_context = load_context(session, old)
    with pytest.raises(LeaseLost):  # … and every write it attempts is refused
        runner.run_step(stale_context)
    with transaction() as session:
        assert session.get(Step, (task_id, 1)) is None
    assert events(task_id) == ["task.queued", "task.started"]

    expire_lease(task_id)
    assert drive(task_id) == "succeeded"


def test_stale_message_for_a_committed_step_is_dropped(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    task_id = submit(client, tenant, scripted_task(calculator_script(2)))
    assert drive(task_id) == "succeeded"
    before = events(task_id)
    runner.advance(task_id, 1)
    assert events(task_id) == before


@pytest.mark.parametrize(
    ("past", "reason"),
    [
        pytest.param({"attempt": 5}, "worker_lost", id="poison-step"),
        pytest.param({"deadline_ms": 1}, "deadline_exceeded", id="deadline"),
    ],
)
def test_a_task_past_its_attempts_or_deadline_fails_and_says_why(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    past: dict[str, int],
    reason: str,
) -> None:
    """A step that has taken its attempts (a poison step) or a task past its deadline fails
    the task, with the reason in its error and ``task.failed`` as its last event."""
    task_id = submit(client, tenant, scripted_task(calculator_script(3)))
    with transaction() as session:
        session.execute(update(Task).where(Task.id == task_id).values(**past))
    assert drive(task_id) == "failed"
    error = task_row(task_id).error
    assert error is not None
    assert error["type"] == reason
    assert events(task_id)[-1] == "task.failed"


def test_transient_errors_retry_then_succeed(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    script = [{"error": "server_error", "times": 2, "content": "fine"}]
    task_id = submit(client, tenant, scripted_task(script))
    assert drive(task_id) == "succeeded"
    assert task_row(task_id).result == {"output": "fine"}


def test_long_backoff_goes_back_through_the_queue(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    configure: Configure,
) -> None:
    configure(RATCHET_MODEL_RETRY_INLINE_MAX_SECONDS="0")
    script = [{"error": "rate_limit", "times": 1, "content": "after the wait"}]
    task_id = submit(client, tenant, scripted_task(script))
    runner.advance(task_id, 1)  # fails once, defers instead of sleeping
    task = task_row(task_id)
    assert (task.status, task.steps, task.model_failures) == ("running", 0, 1)
    assert task.lease_owner is None
    assert task.lease_expires_ms is None
    time.sleep(1.2)  # the 429 paused the model for a second, fleet-wide
    assert drive(task_id) == "succeeded"
    assert task_row(task_id).model_failures == 0


def test_permanent_failure_then_retry_resumes_from_the_last_committed_step(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    journal: Path,
    model_calls: Counter[tuple[str, int]],
) -> None:
    script = [
        tool_turn("upsert_record", key="first"),
        {"error": "server_error", "times": 5, "content": "finally"},
    ]
    task_id = submit(client, tenant, scripted_task(script, agent="ops"))
    assert drive(task_id) == "failed"
    task = task_row(task_id)
    assert task.error is not None
    assert task.error["type"] == "model_unavailable"
    assert task.steps == 1

    response = client.post(f"/v1/tasks/{task_id}/retry", headers=tenant.headers)
    assert response.status_code == 202
    assert response.json()["status"] == "queued"
    assert drive(task_id) == "succeeded"
    assert task_row(task_id).result == {"output": "finally"}
    assert model_calls[(task_id, 1)] == 1  # step 1 was not redone …
    assert journal.read_text().count("upsert") == 1  # … nor its tool call


def test_cancel_takes_effect_at_the_next_commit_point(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    task_id = submit(client, tenant, scripted_task(calculator_script(4)))
    runner.advance(task_id, 1)
    with transaction() as session:  # a worker holds the lease: cancel is only requested
        session.execute(
            update(Task).where(Task.id == task_id).values(lease_expires_ms=10**15, lease_owner="w")
        )
    response = client.post(f"/v1/tasks/{task_id}/cancel", headers=tenant.headers)
    assert response.status_code == 202
    assert response.json()["status"] == "running"
    expire_lease(task_id)
    assert drive(task_id) == "cancelled"
    assert task_row(task_id).steps == 1
    assert events(task_id)[-1] == "task.cancelled"
    again = client.post(f"/v1/tasks/{task_id}/cancel", headers=tenant.headers)
    assert again.status_code == 409


def test_limits_end_the_task_with_the_reason(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    steps = submit(client, tenant, scripted_task(calculator_script(5), max_steps=2))
    tokens = submit(
        client,
        tenant,
        scripted_task(
            [{"content": "big", "usage": {"input_tokens": 900, "output_tokens": 200}}],
            budget={"max_tokens": 1000},
        ),
    )
    assert drive(steps) == "failed"
    assert drive(tokens) == "failed"
    steps_error, tokens_error = task_row(steps).error, task_row(tokens).error
    assert steps_error is not None
    assert steps_error["type"] == "max_steps_exceeded"
    assert task_row(steps).steps == 2
    assert tokens_error is not None
    assert tokens_error["type"] == "budget_exceeded"
    assert task_row(tokens).input_tokens == 900


def test_a_new_task_takes_its_due_time_and_deadline_from_the_database_clock(
    client: TestClient, tenant: TenantHandle
) -> None:
    """A submission is due at once and ends by its deadline, both by the database's clock
    (the only clock leases trust), set as its row goes in; it waits in the backlog."""
    with transaction() as session:
        before = session.scalar(select(now_ms()))
    task_id = submit(client, tenant, scripted_task(calculator_script(1)))
    with transaction() as session:
        after = session.scalar(select(now_ms()))
    row = task_row(task_id)
    assert before is not None
    assert after is not None
    assert row.due_ms is not None
    assert before <= row.due_ms <= after
    deadline_ms = int(get_settings().task_deadline_seconds * 1000)
    assert row.deadline_ms is not None
    assert before + deadline_ms <= row.deadline_ms <= after + deadline_ms
    assert row.admitted_ms is None  # in the backlog until a dispatcher round admits it
    assert (row.steps, row.attempt, row.lease_epoch, row.last_event_seq) == (0, 0, 0, 1)


def test_sweeper_re_enqueues_a_task_whose_message_was_lost(
    client: TestClient, tenant: TenantHandle
) -> None:
    from workers import sweeper

    task_id = submit(client, tenant, scripted_task(calculator_script(2)))
    assert admit() == 1
    with transaction() as session:  # as if the message vanished a minute ago
        session.execute(update(Task).where(Task.id == task_id).values(due_ms=1))
    assert sweeper.sweep_once() >= 1
    due = task_row(task_id).due_ms
    assert due is not None
    assert due > 1
    with transaction() as session:
        assert task_id not in [t for t, _ in tasks.due_for_sweep(session, grace_ms=30_000)]


def test_a_non_idempotent_call_that_overruns_its_limit_is_an_unknown_outcome(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], journal: Path
) -> None:
    """An abandoned call may still act, so it is treated like one cut off by a crash."""
    body = scripted_task([tool_turn("slow_send", seconds=0.6), {"content": "again?"}], agent="ops")
    task_id = submit(client, tenant, body)
    assert drive(task_id) == "failed"
    error = task_row(task_id).error
    assert error is not None
    assert error["type"] == "tool_outcome_unknown"
    assert "timed out after 0.2 s" in error["message"]
    (row,) = ledger_rows(task_id)
    assert (row.status, row.runs) == ("failed", 1)
    time.sleep(0.6)  # the abandoned call finishes on its own, once: nothing ran it again
    assert journal.read_text().count("slow") == 1


# --- races the lease's compare-and-set and the epoch must close --------------------------------


def test_a_write_between_the_lease_read_and_its_update_refuses_the_lease(
    client: TestClient,
    tenant: TenantHandle,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker whose lease ran out defers its step just after another read the task: the
    other's lease must not go ahead on what it read (attempt, failures, waiting are stale)."""
    task_id = submit(client, tenant, scripted_task(calculator_script(2)))
    old = runner.lease_step(task_id, 1)
    assert old is not None
    expire_lease(task_id)
    real_fetch = leases.fetch_one
    done: list[bool] = []

    def read_then_zombie_writes(session: Any, statement: Any, params: dict[str, Any]) -> Any:
        row = real_fetch(session, statement, params)
        if statement is leases.READ_TASK and not done:
            done.append(True)
            values = step_write.release_values(old.lease, delay_ms=0, model_failures=3)
            with write_session() as other:
                step_write.write(
                    other, old.lease, task=old.task, change=step_write.TaskWrite(values)
                )
        return row

    monkeypatch.setattr(leases, "fetch_one", read_then_zombie_writes)
    with write_session() as session:
        refused = leases.take_lease(
            session, task_id, owner="new", ttl_ms=30_000, step=1, max_attempts=5
        )
    assert isinstance(refused, leases.LeaseRefused)
    assert task_row(task_id).model_failures == 3
    assert task_row(task_id).lease_owner is None


def test_a_worker_of_an_old_lease_cannot_write_after_a_poison_fail_and_a_retry(
    client: TestClient, tenant: TenantHandle
) -> None:
    task_id = submit(client, tenant, scripted_task(calculator_script(2)))
    zombie = runner.lease_step(task_id, 1)
    assert zombie is not None
    expire_lease(task_id)
    with transaction() as session:
        session.execute(update(Task).where(Task.id == task_id).values(attempt=5))
    with write_session() as session:
        refused = leases.take_lease(
            session, task_id, owner="next", ttl_ms=30_000, step=1, max_attempts=5
        )
    assert isinstance(refused, leases.LeaseRefused)
    assert task_row(task_id).status == "failed"
    [*_, failed] = events(task_id)
    assert failed == "task.failed"
    retried = client.post(f"/v1/tasks/{task_id}/retry", headers=tenant.headers)
    assert retried.status_code == 202, retried.text

    done = step_write.terminal_values("succeeded", result={"output": "stale"}, steps=1)
    with pytest.raises(LeaseLost), write_session() as session:
        step_write.write(session, zombie.lease, task=zombie.task, change=step_write.TaskWrite(done))
    assert task_row(task_id).status == "queued"


def test_a_retried_task_does_not_ask_the_model_again_for_a_committed_step(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    model_calls: Counter[tuple[str, int]],
) -> None:
    """Failed right after step 1's answer was checkpointed (over budget), then retried: the
    retry replays that answer instead of asking again."""
    body = scripted_task(calculator_script(2), budget={"max_tokens": 1})
    task_id = submit(client, tenant, body)
    assert drive(task_id) == "failed"
    assert client.post(f"/v1/tasks/{task_id}/retry", headers=tenant.headers).status_code == 202
    drive(task_id)
    assert model_calls[(task_id, 1)] == 1


def test_a_step_that_fails_the_same_way_each_time_fails_its_task_with_the_real_error(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    """The usage of the second model call overflows the task's bigint counter at its commit:
    a retry would meet it again, so the task fails at once, saying why (not ``worker_lost``
    after its attempts ran out). On SQLite too, which would store the sum as a float."""
    huge = {"input_tokens": 5 * 10**18, "output_tokens": 0}
    script = [
        {**tool_turn("calculator", expression="1+1"), "usage": huge},
        {"content": "never recorded", "usage": huge},
    ]
    task_id = submit(client, tenant, scripted_task(script))

    assert drive(task_id, max_messages=3) == "failed"

    task = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()
    assert task["error"]["type"] == "internal_error", task
    assert "out of range" in task["error"]["message"], task
    assert "UPDATE" not in task["error"]["message"]  # no SQL, no parameters
    assert task["attempt"] == 1, task  # failed on its first try of step 2
    assert task["usage"]["input_tokens"] == 5 * 10**18, task  # step 1's usage stands
