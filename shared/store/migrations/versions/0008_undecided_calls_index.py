"""The sweeper's index of approvals past their deadline holds only undecided calls with a
deadline, and names no status: a tool call's outcome (its status, result and finish time)
then changes no indexed column, and PostgreSQL updates the row in place (HOT), writing no
index entry

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24 02:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNDECIDED = sa.text("decision IS NULL AND approval_deadline_ms IS NOT NULL")


def upgrade() -> None:
    op.drop_index("ix_tool_calls_awaiting", table_name="tool_calls")
    op.create_index(
        "ix_tool_calls_undecided",
        "tool_calls",
        ["approval_deadline_ms"],
        postgresql_where=UNDECIDED,
        sqlite_where=UNDECIDED,
    )


def downgrade() -> None:
    op.drop_index("ix_tool_calls_undecided", table_name="tool_calls")
    op.create_index("ix_tool_calls_awaiting", "tool_calls", ["status", "approval_deadline_ms"])
