"""The step path on SQLite (the embedded default), where a fenced write runs as several
statements in one transaction rather than as one statement: the same rows, the same refusals.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from tests.conftest import Configure
from tests.helpers import calculator_script


@pytest.fixture
def sqlite_env(tmp_path: Path, configure: Configure) -> None:
    from shared.store.db import migrate

    configure(
        RATCHET_DATABASE_URL=f"sqlite:///{tmp_path / 'ratchet.db'}",
        RATCHET_BROKER_URL="memory://localhost/",
    )
    migrate()


def new_task(steps: int) -> str:
    from shared.store.db import transaction
    from shared.store.tasks import NewTask, create_task
    from shared.store.tenants import create_tenant

    with transaction() as session:
        tenant = create_tenant(session, "sqlite-steps")
        spec = NewTask(
            agent="default",
            model="scripted",
            input="go",
            instructions=None,
            tools=["calculator"],
            model_options={"script": calculator_script(steps)},
            max_steps=steps,
            budget=None,
            webhook=None,
            metadata={},
        )
        return create_task(session, tenant.id, spec).task.id


@pytest.mark.usefixtures("sqlite_env")
def test_a_task_runs_to_the_end_with_every_row_and_event() -> None:
    from shared.store import checkpoints
    from shared.store.db import transaction
    from shared.store.tables import Step, Task, TaskEvent, ToolCall
    from shared.views import task_document
    from workers.steps.runner import advance

    task_id = new_task(3)
    for step in (1, 2, 3):
        advance(task_id, step)
    with transaction() as session:
        task = session.get(Task, task_id)
        assert task is not None
        events = session.scalars(
            select(TaskEvent).where(TaskEvent.task_id == task_id).order_by(TaskEvent.seq)
        ).all()
        steps = session.scalars(select(Step).where(Step.task_id == task_id)).all()
        calls = session.scalars(select(ToolCall).where(ToolCall.task_id == task_id)).all()
        assert task.status == "succeeded"
        assert [e.seq for e in events] == list(range(1, task.last_event_seq + 1))
        assert events[1].type == "task.started"
        assert events[-1].type == "task.succeeded"
        assert events[-1].data == task_document(task)
        assert [(s.number, checkpoints.status(s)) for s in steps] == [
            (n, "completed") for n in (1, 2, 3)
        ]
        assert [(c.call_id, c.status, c.result) for c in calls] == [
            ("1-0", "succeeded", 7),
            ("2-0", "succeeded", 14),
        ]


@pytest.mark.usefixtures("sqlite_env")
def test_a_stale_lease_writes_nothing() -> None:
    from shared.errors import LeaseLost
    from shared.store import leases, step_write
    from shared.store.backends import write_session
    from shared.store.db import transaction
    from shared.store.tables import Task, TaskEvent
    from workers.steps.runner import lease_step

    task_id = new_task(2)
    ctx = lease_step(task_id, 1)
    assert ctx is not None
    stale = leases.Lease(**{**ctx.lease.__dict__, "epoch": ctx.lease.epoch - 1})
    with pytest.raises(LeaseLost), write_session() as session:
        step_write.write(
            session,
            stale,
            task=ctx.task,
            change=step_write.TaskWrite({"steps": 1}, (("step.completed", {}),)),
        )
    with transaction() as session:
        task = session.get(Task, task_id)
        assert task is not None
        assert (task.steps, task.last_event_seq) == (0, 2)
        count = len(session.scalars(select(TaskEvent).where(TaskEvent.task_id == task_id)).all())
        assert count == 2
