"""A task's family: the children its sub-agent calls started (one per call, by the unique
``(parent_id, parent_call_id)``), its descendants, and the usage its children add to it."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.store.tables import Task


def child_of_call(session: Session, parent_id: str, call_id: str) -> Task | None:
    """The child a parent's call started, if it did."""
    return session.scalar(
        select(Task).where(Task.parent_id == parent_id, Task.parent_call_id == call_id)
    )


def children(
    session: Session, parent_id: str, *, limit: int, after_id: str | None = None
) -> tuple[Sequence[Task], str | None]:
    """A page of the task's children, in the order its calls started them; the cursor of
    the next page (None on the last)."""
    query = select(Task).where(Task.parent_id == parent_id)
    if after_id:
        query = query.where(Task.id > after_id)
    rows = session.scalars(query.order_by(Task.id).limit(limit + 1)).all()
    more = len(rows) > limit
    return rows[:limit], (rows[limit - 1].id if more else None)


def descendants(session: Session, task_id: str) -> list[str]:
    """Every task below ``task_id`` in its tree, a generation at a time (its children by the
    ``(parent_id, …)`` index, then theirs): the depth limit bounds the rounds."""
    found: list[str] = []
    generation = [task_id]
    while generation:
        generation = list(
            session.scalars(select(Task.id).where(Task.parent_id.in_(generation))).all()
        )
        found += generation
    return found


def add_children_usage(parent: Task, child: Task) -> None:
    """Roll a settled child's usage (its own and its children's) up into its parent (a row
    the caller locked): what a task used counts what its children did."""
    parent.children_input_tokens += child.input_tokens + child.children_input_tokens
    parent.children_output_tokens += child.output_tokens + child.children_output_tokens
    parent.children_cost_usd += child.cost_usd + child.children_cost_usd
