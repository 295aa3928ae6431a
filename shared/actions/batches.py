"""What a client can do with many tasks at once: submit them as a batch.

One transaction creates the batch and every task it holds, so a batch is there whole or not at
all; it returns the ``Effects`` to send once committed: the webhooks of the tasks' first
events and one wake-up of the dispatcher, which admits them from the backlog like any task.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.actions.effects import NONE, Effects
from shared.agents import versions
from shared.errors import Conflict, IdempotencyMismatch
from shared.scheduling import caps
from shared.store import batches, tasks
from shared.store.db import get_sessionmaker
from shared.store.tables import Batch, Task
from shared.store.tasks import NewTask

# The error of an item whose Idempotency-Key names a task made from a different body (what
# ``IdempotencyMismatch`` is to a single submission).
KEY_REUSED = "idempotency-key-reused"


@dataclass(frozen=True)
class Item:
    """One item of a batch as its front door checked it: a task to create (``spec``, with
    the item's own Idempotency-Key and the hash of its body), or the error that refused it
    (``{"type", "detail", "errors"?}``, kept as given)."""

    spec: NewTask | None = None
    idempotency_key: str | None = None
    request_hash: str | None = None
    error: dict[str, Any] | None = None


@dataclass(frozen=True)
class Submitted:
    """A batch's outcome: the batch (its ``items`` the answer for each item), the status of
    each task it names, whether this request created it (else it answers a repeat of an
    earlier one), and what to send once committed (nothing for a repeat)."""

    batch: Batch
    statuses: dict[str, str]
    created: bool
    effects: Effects = NONE


def submit(
    tenant_id: str,
    tenant_name: str,
    items: Sequence[Item],
    *,
    idempotency_key: str | None,
    request_hash: str,
) -> Submitted:
    """Create the batch and a queued task for each item that has a spec, in one transaction.

    An item whose own Idempotency-Key names a task already made (earlier, or by an item
    before it) answers with that task (``replayed``), or with an error if that task was made
    from a different body. A known batch Idempotency-Key finds the original batch
    (IdempotencyMismatch if its body differs; Conflict while a concurrent request with the
    key, or with one of its items' keys, has not committed). Past the tenant's queue cap the
    whole batch is refused (``caps.check``) and nothing is created."""
    with get_sessionmaker()() as session:
        try:
            with session.begin():
                existing = idempotency_key and batches.find_by_idempotency_key(
                    session, tenant_id, idempotency_key
                )
                if existing:
                    return _replay(session, existing, request_hash)
                return _create(
                    session,
                    tenant_id,
                    tenant_name,
                    items,
                    idempotency_key=idempotency_key,
                    request_hash=request_hash,
                )
        except IntegrityError:
            # A concurrent request with the batch's key, or one of its items' keys, committed
            # first: the batch if it was this one's, else the client's to try again.
            with session.begin():
                existing = idempotency_key and batches.find_by_idempotency_key(
                    session, tenant_id, idempotency_key
                )
                if existing:
                    return _replay(session, existing, request_hash)
            raise Conflict(
                "a request with this Idempotency-Key, or one of its items' keys, is in progress"
            ) from None


def _replay(session: Session, batch: Batch, request_hash: str) -> Submitted:
    if batch.request_hash != request_hash:
        raise IdempotencyMismatch
    ids = [item["task_id"] for item in batch.items if "task_id" in item]
    statuses = batches.statuses_of(session, batch.tenant_id, ids)
    return Submitted(batch, statuses, created=False)


def _create(
    session: Session,
    tenant_id: str,
    tenant_name: str,
    items: Sequence[Item],
    *,
    idempotency_key: str | None,
    request_hash: str,
) -> Submitted:
    keys = [item.idempotency_key for item in items if item.spec and item.idempotency_key]
    known = tasks.find_by_idempotency_keys(session, tenant_id, keys)
    plans = _plan(items, known=known)
    news = [item for item, plan in zip(items, plans, strict=True) if isinstance(plan, _New)]
    caps.check(session, tenant_id, tenant_name, adding=len(news))
    for version in {item.spec.agent_version for item in items if item.spec}:
        if version is not None:  # its row, once per process and version
            versions.record(session, version)
    batch = batches.create_batch(
        session, tenant_id, idempotency_key=idempotency_key, request_hash=request_hash
    )
    creations = [
        (dataclasses.replace(item.spec, batch_id=batch.id), item.idempotency_key, item.request_hash)
        for item in news
        if item.spec is not None
    ]
    created = tasks.create_tasks(session, tenant_id, creations)
    made = [logged.task for logged in created]
    batches.record_items(batch, [_answer(plan, made) for plan in plans])
    session.flush()
    statuses = {task.id: task.status for task in [*made, *known.values()]}
    deliveries = tuple(d for logged in created for d in logged.deliveries)
    # Nobody reads a task that did not exist: only the webhooks, and the dispatcher once.
    effects = Effects(deliveries=deliveries, wake=bool(made))
    return Submitted(batch, statuses, created=True, effects=effects)


@dataclass(frozen=True)
class _New:
    """An item whose task this batch creates: the ``order``-th of its new tasks."""

    order: int


@dataclass(frozen=True)
class _Found:
    """An item whose key names a task made before (``task``), or by an earlier item of the
    batch (the ``order``-th new task)."""

    task: Task | None = None
    order: int = -1


_Plan = _New | _Found | dict[str, Any]  # a dict: the error that refuses the item


def _plan(items: Sequence[Item], *, known: dict[str, Task]) -> list[_Plan]:
    """What becomes of each item: a new task, the task its key names (made before, ``known``
    by key, or by an earlier item with the key), or its error (its own, or its key's with a
    different body)."""
    plans: list[_Plan] = []
    new_keys: dict[str, tuple[int, str | None]] = {}  # key: (order, request hash)
    new = 0
    for index, item in enumerate(items):
        key = item.idempotency_key
        if item.spec is None:
            assert item.error is not None
            plans.append(item.error)
        elif key and key in known:
            same = known[key].request_hash == item.request_hash
            plans.append(_Found(task=known[key]) if same else _key_reused(index, key))
        elif key and key in new_keys:
            order, request_hash = new_keys[key]
            same = request_hash == item.request_hash
            plans.append(_Found(order=order) if same else _key_reused(index, key))
        else:
            plans.append(_New(new))
            if key:
                new_keys[key] = (new, item.request_hash)
            new += 1
    return plans


def _answer(plan: _Plan, made: list[Task]) -> dict[str, Any]:
    """An item's answer as the batch keeps it, once its new tasks (``made``) are in."""
    if isinstance(plan, _New):
        return {"task_id": made[plan.order].id}
    if isinstance(plan, _Found):
        task = plan.task or made[plan.order]
        return {"task_id": task.id, "replayed": True}
    return {"error": plan}


def _key_reused(index: int, key: str | None) -> dict[str, Any]:
    field, pointer = f"tasks[{index}].idempotency_key", f"#/tasks/{index}/idempotency_key"
    reason = f"{key!r} was already used with a different task body"
    errors = [{"field": field, "pointer": pointer, "detail": reason}]
    return {"type": KEY_REUSED, "detail": f"{field}: {reason}", "errors": errors}
