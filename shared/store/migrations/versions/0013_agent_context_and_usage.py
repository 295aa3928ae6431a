"""What the agent's tools and context need: a task's output schema and context policy, the
cached, cache-write and reasoning tokens of each step and task (for honest cost), and the
summaries that the ``summarize`` context policy commits (each replaces the steps it covers
in the prompt, and a crash never recomputes it).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27 18:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
TOKEN_COLUMNS = ("cached_input_tokens", "cache_write_tokens", "reasoning_tokens")


def upgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("output_schema", JSON, nullable=True))
        batch_op.add_column(sa.Column("context", JSON, nullable=True))
        for name in TOKEN_COLUMNS:
            batch_op.add_column(
                sa.Column(name, sa.BigInteger(), nullable=False, server_default="0")
            )
    with op.batch_alter_table("steps", schema=None) as batch_op:
        for name in TOKEN_COLUMNS:
            batch_op.add_column(
                sa.Column(name, sa.BigInteger(), nullable=False, server_default="0")
            )
        # The prompt as sent: its size in tokens (the provider's count, or Ratchet's own).
        batch_op.add_column(
            sa.Column("prompt_tokens", sa.BigInteger(), nullable=False, server_default="0")
        )
    op.create_table(
        "summaries",
        sa.Column("task_id", sa.String(length=36), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("through_step", sa.Integer(), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("cost_usd", sa.Float(), nullable=False, server_default="0"),
        sa.Column("lease_epoch", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("task_id", "number"),
    )


def downgrade() -> None:
    op.drop_table("summaries")
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.drop_column("prompt_tokens")
        for name in reversed(TOKEN_COLUMNS):
            batch_op.drop_column(name)
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        for name in reversed(TOKEN_COLUMNS):
            batch_op.drop_column(name)
        batch_op.drop_column("context")
        batch_op.drop_column("output_schema")
