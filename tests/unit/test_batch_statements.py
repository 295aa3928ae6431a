"""What the one-statement writes say to PostgreSQL (compiled, no database needed)."""

from __future__ import annotations

from sqlalchemy.dialects import postgresql as dialects

from shared.store import fenced, leases, writes
from shared.store.backends import postgresql
from shared.store.batch import Batch
from shared.store.checkpoints import completion
from shared.store.tables import utcnow

LEASE = leases.Lease(task_id="t", epoch=2, owner="w", step=1, attempt=1, ttl_ms=30_000)


def compiled(of: Batch) -> str:
    return str(postgresql._compose(of).compile(dialect=dialects.dialect()))


def write_batch(**values: object) -> Batch:
    changes = {"lease_expires_ms": fenced.FromNow(1), **values}
    shape = fenced.shape_of(changes)
    return Batch(
        fence=writes._write_statement(shape, honour_cancel=True),
        key=("write", shape, True),
        params={},
        events=[("step.completed", {"step": 1})],
        parts=[completion(LEASE)],
        now=utcnow(),
    )


def test_a_step_write_is_one_statement_whose_every_part_depends_on_the_fence() -> None:
    sql = compiled(write_batch(steps=1))
    assert sql.startswith("WITH w AS")
    assert sql.count("UPDATE tasks") == 1
    assert "INSERT INTO task_events" in sql
    assert "FROM w" in sql
    assert "UPDATE steps" in sql
    assert "steps.task_id = w.id" in sql
