"""Agents that compose: a task's family (the parent that started it as a sub-agent, the root
of its tree, its depth, and the usage its settled children added), and durable waits (a tool
call parked on the outside world or on a child task, until a completion, a child's end or its
deadline settles it).

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28 00:40:00
"""

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _where(sql: str) -> dict[str, Any]:
    return {"postgresql_where": sa.text(sql), "sqlite_where": sa.text(sql)}


def upgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("parent_id", sa.String(length=36), nullable=True))
        batch_op.add_column(sa.Column("root_id", sa.String(length=36), nullable=True))
        batch_op.add_column(sa.Column("parent_call_id", sa.String(length=100), nullable=True))
        batch_op.add_column(sa.Column("depth", sa.SmallInteger(), server_default="0", nullable=False))
        batch_op.add_column(
            sa.Column("children_input_tokens", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch_op.add_column(
            sa.Column("children_output_tokens", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch_op.add_column(sa.Column("children_cost_usd", sa.Float(), server_default="0", nullable=False))
        batch_op.create_foreign_key(
            "fk_tasks_parent_id", "tasks", ["parent_id"], ["id"], ondelete="CASCADE"
        )
    # One child per parent's call: a crash between creating it and committing the call
    # finds it again instead of starting a second. Also the parent's list of its children.
    op.create_index(
        "uq_tasks_parent_call",
        "tasks",
        ["parent_id", "parent_call_id"],
        unique=True,
        **_where("parent_id IS NOT NULL"),
    )
    op.create_table(
        "waits",
        sa.Column("token", sa.String(length=64), primary_key=True),
        sa.Column(
            "task_id",
            sa.String(length=36),
            sa.ForeignKey("tasks.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("tenant_id", sa.String(length=36), nullable=False),
        sa.Column("call_id", sa.String(length=100), nullable=False),
        sa.Column("step_number", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("child_id", sa.String(length=36), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("request", JSON, nullable=True),
        sa.Column("payload", JSON, nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("deadline_ms", sa.BigInteger(), nullable=True),
        sa.Column("on_timeout", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("settled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("settled_by", sa.String(length=200), nullable=True),
        sa.UniqueConstraint("task_id", "call_id", name="uq_waits_task_call"),
    )
    op.create_index(
        "ix_waits_pending_deadline", "waits", ["deadline_ms"], **_where("status = 'pending'")
    )
    op.create_index(
        "ix_waits_pending_child", "waits", ["child_id"], **_where("status = 'pending'")
    )


def downgrade() -> None:
    op.drop_index("ix_waits_pending_child", table_name="waits")
    op.drop_index("ix_waits_pending_deadline", table_name="waits")
    op.drop_table("waits")
    op.drop_index("uq_tasks_parent_call", table_name="tasks")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_constraint("fk_tasks_parent_id", type_="foreignkey")
        for column in (
            "children_cost_usd",
            "children_output_tokens",
            "children_input_tokens",
            "depth",
            "parent_call_id",
            "root_id",
            "parent_id",
        ):
            batch_op.drop_column(column)
