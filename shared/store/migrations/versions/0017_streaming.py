"""Live token streaming: whether a task's model calls stream (the submission's ``stream``;
null: its agent's choice, else the server's default). The deltas themselves never reach the
database.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27 21:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("stream", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_column("stream")
