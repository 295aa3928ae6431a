"""Live token streaming: whether a task's model calls stream.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27 21:30:00
"""

from collections.abc import Sequence

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
