"""Leaner task indexes: the idempotency key's and the finish time's hold only rows that have
one, so a task's updates while it runs (most have no key, none has a finish time) write two
index entries fewer each

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 23:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

HAS_KEY = sa.text("idempotency_key IS NOT NULL")
FINISHED = sa.text("finished_at IS NOT NULL")


def upgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_constraint("uq_tasks_tenant_idempotency_key", type_="unique")
    op.create_index(
        "uq_tasks_tenant_idempotency_key",
        "tasks",
        ["tenant_id", "idempotency_key"],
        unique=True,
        postgresql_where=HAS_KEY,
        sqlite_where=HAS_KEY,
    )
    op.drop_index("ix_tasks_finished_at", table_name="tasks")
    op.create_index(
        "ix_tasks_finished_at",
        "tasks",
        ["finished_at"],
        postgresql_where=FINISHED,
        sqlite_where=FINISHED,
    )


def downgrade() -> None:
    op.drop_index("ix_tasks_finished_at", table_name="tasks")
    op.create_index("ix_tasks_finished_at", "tasks", ["finished_at"])
    op.drop_index("uq_tasks_tenant_idempotency_key", table_name="tasks")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.create_unique_constraint(
            "uq_tasks_tenant_idempotency_key", ["tenant_id", "idempotency_key"]
        )
