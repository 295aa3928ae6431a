"""Pinned agent versions: the agent definitions tasks ran with, content-addressed, and which one
each task runs.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27 21:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "agent_versions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("agent", sa.String(length=100), nullable=False),
        sa.Column("definition", JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_agent_versions_agent_created",
        "agent_versions",
        ["agent", "created_at", "id"],
        unique=False,
    )
    # Nullable, no default: adding it rewrites no row, and tasks from before keep the live
    # registry's agent.
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("agent_version", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_column("agent_version")
    op.drop_index("ix_agent_versions_agent_created", table_name="agent_versions")
    op.drop_table("agent_versions")
