"""Threads: conversations whose turns are tasks, and how a turn joins its thread.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27 21:30:00
"""

from collections.abc import Sequence

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
