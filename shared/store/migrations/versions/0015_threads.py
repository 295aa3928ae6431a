"""Threads: conversations whose turns are tasks, and how a turn joins its thread.

A fork of a thread (``forked_from``, ``fork_turn``) holds its source's turns up to
``fork_turn`` in its history by reference, and numbers its own turns after them.

A turn is a task with ``thread_id`` and ``turn`` (its number in the thread, from 1). A turn
sent while an earlier one is unfinished waits, ``turn_held``, until the dispatcher releases it
(``shared.store.threads``); a partial unique index lets at most one turn of a thread be
unfinished and not held, so two turns never run at once whatever the code does. A turn
cancelled by a ``rollback`` is ``rolled_back``: its rows stay, but it leaves the history.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27 21:30:00
"""

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
UNFINISHED = "status NOT IN ('succeeded', 'failed', 'cancelled')"


def _where(sql: str) -> dict[str, Any]:
    return {"postgresql_where": sa.text(sql), "sqlite_where": sa.text(sql)}


def upgrade() -> None:
    op.create_table(
        "threads",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("tenant_id", sa.String(length=36), nullable=False),
        sa.Column("agent", sa.String(length=100), nullable=False),
        sa.Column("metadata", JSON, nullable=False),
        sa.Column("turns", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("forked_from", sa.String(length=36), nullable=True),
        sa.Column("fork_turn", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["forked_from"], ["threads.id"], name="fk_threads_forked_from"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_threads_forked_from", "threads", ["forked_from"], **_where("forked_from IS NOT NULL")
    )
    op.create_index("ix_threads_tenant_id_id", "threads", ["tenant_id", "id"])
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("thread_id", sa.String(length=36), nullable=True))
        batch_op.add_column(sa.Column("turn", sa.Integer(), nullable=True))
        batch_op.add_column(
            sa.Column("turn_held", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch_op.add_column(
            sa.Column("rolled_back", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch_op.create_foreign_key(
            "fk_tasks_thread_id", "threads", ["thread_id"], ["id"], ondelete="CASCADE"
        )
    op.create_index(
        "uq_tasks_thread_turn",
        "tasks",
        ["thread_id", "turn"],
        unique=True,
        **_where("thread_id IS NOT NULL"),
    )
    op.create_index(
        "uq_tasks_thread_running",
        "tasks",
        ["thread_id"],
        unique=True,
        **_where(f"thread_id IS NOT NULL AND NOT turn_held AND {UNFINISHED}"),
    )
    op.create_index("ix_tasks_held", "tasks", ["thread_id", "turn"], **_where("turn_held"))


def downgrade() -> None:
    op.drop_index("ix_tasks_held", table_name="tasks")
    op.drop_index("uq_tasks_thread_running", table_name="tasks")
    op.drop_index("uq_tasks_thread_turn", table_name="tasks")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_constraint("fk_tasks_thread_id", type_="foreignkey")
        batch_op.drop_column("rolled_back")
        batch_op.drop_column("turn_held")
        batch_op.drop_column("turn")
        batch_op.drop_column("thread_id")
    op.drop_index("ix_threads_forked_from", table_name="threads")
    op.drop_index("ix_threads_tenant_id_id", table_name="threads")
    op.drop_table("threads")
