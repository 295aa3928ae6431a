"""What the one-statement writes say to PostgreSQL (compiled, no database needed)."""

from __future__ import annotations

from sqlalchemy.dialects import postgresql as dialects

from shared.store import fenced, leases, step_write
from shared.store.backends import postgresql
from shared.store.batch import Batch, Increment
from shared.store.checkpoints import complete_checkpoint
from shared.store.tables import utcnow

LEASE = leases.Lease(task_id="t", epoch=2, owner="w", step=1, attempt=1, ttl_ms=30_000)


def compiled(of: Batch) -> str:
    return str(postgresql._compose(of).compile(dialect=dialects.dialect()))


def write_batch(**values: object) -> Batch:
    changes = {"lease_expires_ms": fenced.FromNow(1), **values}
    shape = fenced.shape_of(changes)
    return Batch(
        fence=step_write._write_statement(shape, honour_cancel=True),
        key=("write", shape, True),
        params={},
        events=[("step.completed", {"step": 1})],
        parts=[complete_checkpoint(LEASE)],
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


def bound_names(clause: object) -> set[str]:
    from sqlalchemy.sql import visitors
    from sqlalchemy.sql.elements import BindParameter

    return {node.key for node in visitors.iterate(clause) if isinstance(node, BindParameter)}


def test_a_compare_and_set_binds_the_row_as_read_apart_from_what_it_writes() -> None:
    """The lease and the poison fail compare the row with its values as read and write new
    ones, often to the same columns (``updated_at``, ``status``): one name for both would
    write the old value back."""
    now = utcnow()
    for queued in (True, False):
        changes = leases._lease_changes(owner="w", ttl_ms=1, now=now, queued=queued)
        statement = leases._lease_statement(fenced.shape_of(changes))
        read = bound_names(statement.whereclause)
        written = set().union(
            *(bound_names(v) for v in fenced.assignments(fenced.shape_of(changes)).values())
        )
        assert read
        assert written
        assert not read & written, (read, written)
        assert written == set(fenced.params_of(changes))
    terminal = {**step_write.terminal_values("failed", error={}), "lease_epoch": Increment(1)}
    poison = leases._poison_statement(fenced.shape_of(terminal))
    assert "b_updated_at" not in bound_names(poison.whereclause)


def test_a_lease_predicts_the_row_its_set_clause_leaves() -> None:
    """The lease's values and its prediction come from one description: each written column
    is bound from that description's own parameter."""
    changes = leases._lease_changes(owner="w", ttl_ms=5, now=utcnow(), queued=True)
    clause = fenced.assignments(fenced.shape_of(changes))
    assert set(clause) == set(changes)
    assert {f"b_{k}" for k in clause} == set(fenced.params_of(changes))
