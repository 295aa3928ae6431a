"""Batches: many tasks submitted in one request (``POST /v1/tasks/batch``). A batch row keeps
its Idempotency-Key, the hash of its body and the answer it gave for each item, so a repeat
of the request answers the same; each task it created names it (``tasks.batch_id``).

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-28 01:00:00
"""

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _where(sql: str) -> dict[str, Any]:
    return {"postgresql_where": sa.text(sql), "sqlite_where": sa.text(sql)}


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=36), primary_key=True),
        sa.Column(
            "tenant_id",
            sa.String(length=36),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("task_count", sa.Integer(), nullable=False),
        sa.Column("refused_count", sa.Integer(), nullable=False),
        sa.Column("items", JSON, nullable=False),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("request_hash", sa.String(length=64), nullable=True),
    )
    op.create_index(
        "uq_batches_tenant_idempotency_key",
        "batches",
        ["tenant_id", "idempotency_key"],
        unique=True,
        **_where("idempotency_key IS NOT NULL"),
    )
    op.create_index("ix_batches_tenant_id_id", "batches", ["tenant_id", "id"])
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("batch_id", sa.String(length=36), nullable=True))
        batch_op.create_foreign_key(
            "fk_tasks_batch_id", "batches", ["batch_id"], ["id"], ondelete="CASCADE"
        )
    op.create_index("ix_tasks_batch", "tasks", ["batch_id"], **_where("batch_id IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("ix_tasks_batch", table_name="tasks")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_constraint("fk_tasks_batch_id", type_="foreignkey")
        batch_op.drop_column("batch_id")
    op.drop_index("ix_batches_tenant_id_id", table_name="batches")
    op.drop_index("uq_batches_tenant_idempotency_key", table_name="batches")
    op.drop_table("batches")
