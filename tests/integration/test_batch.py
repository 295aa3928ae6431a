"""The fenced write, one statement on PostgreSQL and several in one transaction on SQLite: all
or nothing either way, and the Task its events carry is the row it wrote (the document is
predicted before the write, so this is checked).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from shared.errors import CancelRequested, LeaseLost
from shared.store import leases, step_write
from shared.store.backends import fetch_one, write_session
from shared.store.db import transaction
from shared.store.tables import Step, Task, TaskEvent, WebhookDelivery, utcnow
from shared.views import task_document
from tests.conftest import TenantHandle
from tests.helpers import calculator_script, scripted_task, tool_turn
from workers.steps import runner

pytestmark = pytest.mark.backends("postgresql", "sqlite")


def submit(client: TestClient, tenant: TenantHandle, body: dict[str, Any]) -> str:
    response = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert response.status_code == 202, response.text
    task_id: str = response.json()["id"]
    return task_id


def events_of(task_id: str) -> list[TaskEvent]:
    with transaction() as session:
        return list(
            session.scalars(
                select(TaskEvent).where(TaskEvent.task_id == task_id).order_by(TaskEvent.seq)
            )
        )


def stored_document(task_id: str) -> dict[str, Any]:
    with transaction() as session:
        task = session.get(Task, task_id)
        assert task is not None
        return task_document(task)


def test_each_event_of_a_run_has_the_next_seq_and_the_terminal_one_carries_the_stored_task(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    task_id = submit(client, tenant, scripted_task(calculator_script(3)))
    assert drive(task_id) == "succeeded"
    events = events_of(task_id)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[-1].type == "task.succeeded"
    assert events[-1].data == stored_document(task_id)
    assert client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json() == events[-1].data
    with transaction() as session:
        task = session.get(Task, task_id)
        assert task is not None
        assert task.last_event_seq == len(events)


def test_the_started_event_carries_the_task_as_the_lease_left_it(
    client: TestClient, tenant: TenantHandle
) -> None:
    task_id = submit(client, tenant, scripted_task(calculator_script(2)))
    ctx = runner.lease_step(task_id, 1)
    assert ctx is not None
    started = events_of(task_id)[-1]
    assert started.type == "task.started"
    assert started.data == stored_document(task_id)
    assert started.data["status"] == "running"
    assert started.data["attempt"] == 1


@pytest.mark.parametrize("budget", [{"max_tokens": 1}])
def test_a_failure_event_carries_the_usage_the_same_write_added(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], budget: dict[str, Any]
) -> None:
    task_id = submit(client, tenant, scripted_task(calculator_script(2), budget=budget))
    assert drive(task_id) == "failed"
    [*_, failed] = events_of(task_id)
    assert failed.type == "task.failed"
    assert failed.data["error"]["type"] == "budget_exceeded"
    assert failed.data["usage"]["input_tokens"] > 0
    assert failed.data == stored_document(task_id)


def test_a_cancel_at_the_fence_writes_the_cancelled_task_as_stored(
    client: TestClient, tenant: TenantHandle
) -> None:
    script = [{"delay_ms": 0, **tool_turn("calculator", expression="1+1")}, {"content": "x"}]
    task_id = submit(client, tenant, scripted_task(script))
    ctx = runner.lease_step(task_id, 1)
    assert ctx is not None
    assert client.post(f"/v1/tasks/{task_id}/cancel", headers=tenant.headers).status_code == 202
    assert runner.run_leased(ctx) == "ended"
    [*_, cancelled] = events_of(task_id)
    assert cancelled.type == "task.cancelled"
    assert cancelled.data == stored_document(task_id)


def test_a_refused_write_writes_nothing_at_all(client: TestClient, tenant: TenantHandle) -> None:
    """The fence fails: no event, no checkpoint, no delivery, no change to the row."""
    task_id = submit(
        client, tenant, scripted_task(calculator_script(2), webhook={"url": "http://127.0.0.1:9/"})
    )
    ctx = runner.lease_step(task_id, 1)
    assert ctx is not None
    lease = ctx.lease
    stale = leases.Lease(**{**lease.__dict__, "epoch": lease.epoch - 1})
    before = (stored_document(task_id), len(events_of(task_id)))
    done = step_write.terminal_values("succeeded", result={"output": "x"}, steps=1)
    with pytest.raises(LeaseLost), write_session() as session:
        step_write.write(
            session,
            stale,
            task=ctx.task,
            change=step_write.TaskWrite(
                done, (("step.completed", {"step": 1}), ("task.succeeded", task_document))
            ),
        )
    assert (stored_document(task_id), len(events_of(task_id))) == before
    with transaction() as session:
        assert session.get(Step, (task_id, 1)) is None
        terminal = select(WebhookDelivery).where(
            WebhookDelivery.task_id == task_id, WebhookDelivery.event_type == "task.succeeded"
        )
        assert session.scalars(terminal).all() == []

    # The same write under the live lease, with the client's cancel pending: refused as a
    # cancel, again with nothing written.
    with transaction() as session:
        session.execute(
            Task.__table__.update().where(Task.id == task_id).values(cancel_requested_at=utcnow())
        )
    with pytest.raises(CancelRequested), write_session() as session:
        step_write.write(session, lease, task=ctx.task, change=step_write.TaskWrite(done))
    after = stored_document(task_id)
    assert after["cancel_requested_at"] is not None  # the client's, left for the worker
    assert after | {"cancel_requested_at": None} == before[0]


# PostgreSQL only: only there does fetch_one send a statement compiled once through the driver;
# on SQLite it is SQLAlchemy's own execute, so there is nothing to compare.
@pytest.mark.backends("postgresql")
def test_a_statement_compiled_once_returns_what_sqlalchemy_would(
    client: TestClient, tenant: TenantHandle
) -> None:
    task_id = submit(client, tenant, scripted_task(calculator_script(2), metadata={"k": "v"}))
    with transaction() as session:
        fast = fetch_one(session, leases.READ_TASK, {"b_task_id": task_id})
        slow = session.execute(leases.READ_TASK, {"b_task_id": task_id}).one()
    assert fast is not None
    fast_row, slow_row = fast._asdict(), slow._asdict()
    assert abs(fast_row.pop("clock_ms") - slow_row.pop("clock_ms")) < 1000  # two reads of a clock
    assert fast_row == slow_row


# PostgreSQL only: it reads the one-statement CTE and its synchronous_commit setting, neither
# of which exists on SQLite.
@pytest.mark.backends("postgresql")
def test_only_the_lease_commits_without_waiting_for_its_wal_flush(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    """Checkpoints must survive a database crash once committed; a lease need not (lost, it
    was never taken), unless it logs task.started, which readers are woken to at once."""
    from benchmarks.harness.meter import watching_direct_sends

    sent: list[tuple[str, dict[str, Any]]] = []
    with watching_direct_sends(lambda _c, sql, values: sent.append((sql, values))):
        task_id = submit(client, tenant, scripted_task(calculator_script(3)))
        assert drive(task_id) == "succeeded"
    writes = [(sql, values) for sql, values in sent if sql.startswith("WITH w AS")]
    leases = [w for w in writes if "lease_epoch=(tasks.lease_epoch +" in w[0]]
    lazy = [w for w in writes if "synchronous_commit" in w[1].values()]
    assert len(leases) == 3
    starting = [w for w in leases if "INSERT INTO task_events" in w[0]]
    assert len(starting) == 1
    assert lazy == [w for w in leases if w not in starting]
    assert len(writes) > len(leases)


def test_each_delivery_names_the_event_it_carries_whatever_the_event_count(
    client: TestClient, tenant: TenantHandle
) -> None:
    """Two writes of the same shape, one event then two: every delivery's event_seq is the
    seq of an event of its own type (the statement is cached, the count is not)."""
    webhook = {"url": "http://127.0.0.1:9/", "events": ["step.completed", "step.tool_call"]}
    task_id = submit(client, tenant, scripted_task(calculator_script(3), webhook=webhook))
    ctx = runner.lease_step(task_id, 1)
    assert ctx is not None
    for events in (
        [("step.completed", {"step": 0})],
        [("step.tool_call", {"n": 1}), ("step.completed", {"step": 0})],
    ):
        with write_session() as session:
            change = step_write.log_events(*events)
            ctx.task = step_write.write(session, ctx.lease, task=ctx.task, change=change).task
    by_seq = {e.seq: e.type for e in events_of(task_id)}
    with transaction() as session:
        rows = session.scalars(
            select(WebhookDelivery).where(
                WebhookDelivery.task_id == task_id, WebhookDelivery.event_type.like("step.%")
            )
        ).all()
    assert sorted(r.event_type for r in rows) == [
        "step.completed",
        "step.completed",
        "step.tool_call",
    ]
    assert all(by_seq[r.event_seq] == r.event_type for r in rows)
