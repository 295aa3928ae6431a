"""Batches: the row that answers for many tasks submitted in one request, and its tasks'
progress. Creating a batch's tasks is ``tasks.create_task``'s, each naming the batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.errors import NotFound
from shared.ids import new_id
from shared.store.tables import Batch, Task


def create_batch(
    session: Session, tenant_id: str, *, idempotency_key: str | None, request_hash: str
) -> Batch:
    """Insert an empty batch (its tasks then name it); :func:`record_items` completes it in
    the same transaction. A concurrent batch with the same key fails the commit."""
    batch = Batch(
        id=new_id(),
        tenant_id=tenant_id,
        task_count=0,
        refused_count=0,
        items=[],
        idempotency_key=idempotency_key,
        request_hash=request_hash,
    )
    session.add(batch)
    session.flush()
    return batch


def record_items(batch: Batch, items: list[dict[str, Any]]) -> None:
    """The batch's answer for each item (``{"task_id": …}``, with ``"replayed": true`` for a
    task an item's Idempotency-Key found, or ``{"error": …}``), kept for a repeat of the
    request, and its counts."""
    batch.items = items
    batch.task_count = sum(1 for item in items if "task_id" in item and not item.get("replayed"))
    batch.refused_count = sum(1 for item in items if "error" in item)


def find_by_idempotency_key(session: Session, tenant_id: str, key: str) -> Batch | None:
    return session.scalar(
        select(Batch).where(Batch.tenant_id == tenant_id, Batch.idempotency_key == key)
    )


def get_batch(session: Session, tenant_id: str, batch_id: str) -> Batch:
    """The tenant's batch. Another tenant's is indistinguishable from a missing one."""
    batch = session.scalar(select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id))
    if batch is None:
        raise NotFound(f"no batch {batch_id}")
    return batch


def task_statuses(session: Session, batch_id: str) -> Sequence[tuple[str, str]]:
    """(id, status) of each task the batch created, by id (about the order they were made)."""
    rows = session.execute(
        select(Task.id, Task.status).where(Task.batch_id == batch_id).order_by(Task.id)
    ).all()
    return [(row.id, row.status) for row in rows]


def statuses_of(session: Session, tenant_id: str, task_ids: Sequence[str]) -> dict[str, str]:
    """The status of each of the tenant's tasks in ``task_ids``, by id."""
    if not task_ids:
        return {}
    rows = session.execute(
        select(Task.id, Task.status).where(Task.tenant_id == tenant_id, Task.id.in_(task_ids))
    ).all()
    return {row.id: row.status for row in rows}
