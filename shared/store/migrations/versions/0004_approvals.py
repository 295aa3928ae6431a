"""Approvals: a task's approval policy; a tool call's decision, who made it, and its deadline

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 17:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("approval", JSON, nullable=True))
    with op.batch_alter_table("tool_calls", schema=None) as batch_op:
        batch_op.add_column(sa.Column("decision", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("decided_by", sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("decision_reason", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("original_arguments", JSON, nullable=True))
        batch_op.add_column(sa.Column("approval_deadline_ms", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("approval_on_timeout", sa.String(length=16), nullable=True))
    op.create_index("ix_tool_calls_awaiting", "tool_calls", ["status", "approval_deadline_ms"])


def downgrade() -> None:
    op.drop_index("ix_tool_calls_awaiting", table_name="tool_calls")
    with op.batch_alter_table("tool_calls", schema=None) as batch_op:
        for name in (
            "approval_on_timeout",
            "approval_deadline_ms",
            "original_arguments",
            "decision_reason",
            "decided_at",
            "decided_by",
            "decision",
        ):
            batch_op.drop_column(name)
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_column("approval")
