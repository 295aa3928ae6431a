"""Each webhook endpoint's circuit breaker: its failures in a row, and whether its deliveries
are being sent (``closed``), held back for a while (``open``) or tried by one probe
(``half_open``) — see ``shared.webhooks.circuits``.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("webhook_endpoints", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("consecutive_failures", sa.Integer(), nullable=False, server_default="0")
        )
        batch_op.add_column(
            sa.Column(
                "circuit_state", sa.String(length=16), nullable=False, server_default="closed"
            )
        )
        batch_op.add_column(sa.Column("circuit_until_ms", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("webhook_endpoints", schema=None) as batch_op:
        batch_op.drop_column("circuit_until_ms")
        batch_op.drop_column("circuit_state")
        batch_op.drop_column("consecutive_failures")
