"""Fair scheduling: the backlog's admission, priorities, run_at, concurrency limits set at
runtime, schedules, and the dispatch's leader

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 19:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
RUNNABLE = "status IN ('queued', 'running')"


def upgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("admitted_ms", sa.BigInteger(), nullable=True))
        batch_op.add_column(
            sa.Column("priority", sa.SmallInteger(), nullable=False, server_default="0")
        )
        batch_op.add_column(sa.Column("run_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("schedule_id", sa.String(length=36), nullable=True))
    # Runnable tasks of the version before have their messages already: they count as admitted.
    op.execute(f"UPDATE tasks SET admitted_ms = COALESCE(due_ms, 0) WHERE {RUNNABLE}")
    backlog = sa.text(f"admitted_ms IS NULL AND {RUNNABLE}")
    admitted = sa.text(f"admitted_ms IS NOT NULL AND {RUNNABLE}")
    op.create_index(
        "ix_tasks_backlog",
        "tasks",
        ["tenant_id", sa.text("priority DESC"), "due_ms"],
        postgresql_where=backlog,
        sqlite_where=backlog,
    )
    op.create_index(
        "ix_tasks_admitted",
        "tasks",
        ["tenant_id"],
        postgresql_where=admitted,
        sqlite_where=admitted,
    )
    op.create_table(
        "concurrency_limits",
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("spec", JSON, nullable=False),
        sa.Column("updated_by", sa.String(length=200), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("kind", "name"),
    )
    op.create_table(
        "leaders",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("expires_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "schedules",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("tenant_id", sa.String(length=36), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("cron", sa.String(length=200), nullable=False),
        sa.Column("timezone", sa.String(length=64), nullable=False),
        sa.Column("body", JSON, nullable=False),
        sa.Column("catch_up", sa.String(length=16), nullable=False),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("next_fire_ms", sa.BigInteger(), nullable=False),
        sa.Column("last_fired_ms", sa.BigInteger(), nullable=True),
        sa.Column("last_task_id", sa.String(length=36), nullable=True),
        sa.Column("fired", sa.BigInteger(), nullable=False),
        sa.Column("skipped", sa.BigInteger(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_by", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "name", name="uq_schedules_tenant_name"),
    )
    op.create_index(
        "ix_schedules_due",
        "schedules",
        ["next_fire_ms"],
        postgresql_where=sa.text("NOT paused"),
    )


def downgrade() -> None:
    op.drop_index("ix_schedules_due", table_name="schedules")
    op.drop_table("schedules")
    op.drop_table("leaders")
    op.drop_table("concurrency_limits")
    op.drop_index("ix_tasks_admitted", table_name="tasks")
    op.drop_index("ix_tasks_backlog", table_name="tasks")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        for name in ("schedule_id", "run_at", "priority", "admitted_ms"):
            batch_op.drop_column(name)
