"""Forks: a task that starts from another task's committed steps. The fork names its origin
(``tasks.forked_from``: the task and step it was forked from, and what it replaced), and a
tool call it inherited keeps the task that ran it (``tool_calls.inherited_from``), whose
idempotency key it ran with.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-27 21:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("forked_from", JSON, nullable=True))
    with op.batch_alter_table("tool_calls", schema=None) as batch_op:
        batch_op.add_column(sa.Column("inherited_from", sa.String(length=36), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tool_calls", schema=None) as batch_op:
        batch_op.drop_column("inherited_from")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_column("forked_from")
