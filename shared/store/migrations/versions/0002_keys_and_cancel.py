"""API key names, expiry and last use; when a cancel was requested

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 08:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("name", sa.String(length=100), nullable=True))
        batch_op.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True)
        )
    op.execute("UPDATE tasks SET cancel_requested_at = updated_at WHERE cancel_requested")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_column("cancel_requested")


def downgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("cancel_requested", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    op.execute("UPDATE tasks SET cancel_requested = cancel_requested_at IS NOT NULL")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_column("cancel_requested_at")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_column("last_used_at")
        batch_op.drop_column("expires_at")
        batch_op.drop_column("name")
