"""An index of the webhook deliveries that failed for good, by creation time

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 17:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FAILED = sa.text("status IN ('failed', 'disabled')")


def upgrade() -> None:
    op.create_index(
        "ix_webhook_deliveries_failed",
        "webhook_deliveries",
        ["created_at"],
        postgresql_where=FAILED,
        sqlite_where=FAILED,
    )


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_failed", table_name="webhook_deliveries")
