"""The tool-call ledger is keyed by its (task, call id), the key it was already unique on; the
surrogate id, which nothing read, is gone, and with it an index entry every call wrote

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24 08:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _postgresql() -> bool:
    return bool(op.get_bind().dialect.name == "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("tool_calls", schema=None) as batch_op:
        batch_op.drop_constraint("uq_tool_calls_task_call", type_="unique")
        if _postgresql():  # SQLite's is unnamed, and goes with its column
            batch_op.drop_constraint("tool_calls_pkey", type_="primary")
        batch_op.drop_column("id")
        batch_op.create_primary_key("tool_calls_pkey", ["task_id", "call_id"])


def downgrade() -> None:
    postgresql = _postgresql()
    with op.batch_alter_table("tool_calls", schema=None) as batch_op:
        batch_op.drop_constraint("tool_calls_pkey", type_="primary")
        batch_op.add_column(sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite")))
        batch_op.create_unique_constraint("uq_tool_calls_task_call", ["task_id", "call_id"])
        if not postgresql:  # an INTEGER key: SQLite numbers the copied rows itself
            batch_op.create_primary_key("tool_calls_pkey", ["id"])
    if postgresql:
        op.execute("CREATE SEQUENCE tool_calls_id_seq OWNED BY tool_calls.id")
        op.execute("UPDATE tool_calls SET id = nextval('tool_calls_id_seq')")
        op.execute("ALTER TABLE tool_calls ALTER COLUMN id SET DEFAULT nextval('tool_calls_id_seq')")
        op.alter_column("tool_calls", "id", nullable=False)
        op.create_primary_key("tool_calls_pkey", "tool_calls", ["id"])
