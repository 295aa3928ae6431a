"""A step's status and a tool call's idempotency key are no longer stored: the step's
completion time says whether it is complete, and the key is its call's (task, call id). A
step's completion then writes its row's last column alone, and a call's outcome a shorter
stretch of its row, so PostgreSQL logs far fewer bytes of each (dropping a column rewrites
nothing)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24 08:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.drop_column("status")
    with op.batch_alter_table("tool_calls", schema=None) as batch_op:
        batch_op.drop_column("idempotency_key")


def downgrade() -> None:
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.add_column(sa.Column("status", sa.String(32), nullable=True))
    op.execute(
        "UPDATE steps SET status = CASE WHEN completed_at IS NULL "
        "THEN 'model_responded' ELSE 'completed' END"
    )
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.alter_column("status", existing_type=sa.String(32), nullable=False)
    with op.batch_alter_table("tool_calls", schema=None) as batch_op:
        batch_op.add_column(sa.Column("idempotency_key", sa.String(200), nullable=True))
    op.execute("UPDATE tool_calls SET idempotency_key = task_id || ':' || call_id")
    with op.batch_alter_table("tool_calls", schema=None) as batch_op:
        batch_op.alter_column("idempotency_key", existing_type=sa.String(200), nullable=False)
