"""Tenant MCP servers (``/v1/mcp-servers``): Streamable HTTP servers a tenant registers for
its own tasks, their headers encrypted (they may hold credentials, or name the tenant's
secrets).

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-28 02:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "tenant_mcp_servers",
        sa.Column("id", sa.String(length=36), primary_key=True),
        sa.Column(
            "tenant_id",
            sa.String(length=36),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("url", sa.String(length=2048), nullable=False),
        sa.Column("headers_ciphertext", sa.Text(), nullable=True),
        sa.Column("header_names", JSON, nullable=False),
        sa.Column("timeout_seconds", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("tenant_id", "name", name="uq_tenant_mcp_servers_tenant_name"),
    )


def downgrade() -> None:
    op.drop_table("tenant_mcp_servers")
