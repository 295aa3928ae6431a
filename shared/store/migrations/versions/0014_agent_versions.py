"""Pinned agent versions: the agent definitions tasks ran with, content-addressed, and which one
each task runs.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27 21:30:00
"""

from collections.abc import Sequence

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
