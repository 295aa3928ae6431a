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
    unkeyed = sum(1 for item in items if item.spec and not item.idempotency_key)
    caps.check(session, tenant_id, tenant_name, adding=unkeyed + len(set(keys) - set(known)))
    for version in {item.spec.agent_version for item in items if item.spec}:
        if version is not None:  # its row, once per process and version
            versions.record(session, version)
    batch = batches.create_batch(
        session, tenant_id, idempotency_key=idempotency_key, request_hash=request_hash
    )
    answers: list[dict[str, Any]] = []
    statuses: dict[str, str] = {}
    deliveries: list[str] = []
    for index, item in enumerate(items):
        answer, task = _answer(session, batch, item, index, known=known, deliveries=deliveries)
        answers.append(answer)
        if task is not None:
            statuses[task.id] = task.status
    batches.record_items(batch, answers)
    session.flush()
    # Nobody reads a task that did not exist: only the webhooks, and the dispatcher once.
    effects = Effects(deliveries=tuple(deliveries), wake=batch.task_count > 0)
    return Submitted(batch, statuses, created=True, effects=effects)


def _answer(
    session: Session,
    batch: Batch,
    item: Item,
    index: int,
    *,
    known: dict[str, Task],
    deliveries: list[str],
) -> tuple[dict[str, Any], Task | None]:
    """The answer for one item, and its task: created here (``known`` learns its key, so a
    later item with the key finds it), or the one its key found."""
    if item.spec is None:
        assert item.error is not None
        return {"error": item.error}, None
    key = item.idempotency_key
    found = known.get(key) if key else None
    if found is not None:
        if found.request_hash != item.request_hash:
            return {"error": _key_reused(index, key)}, None
        return {"task_id": found.id, "replayed": True}, found
    spec = dataclasses.replace(item.spec, batch_id=batch.id)
    logged = tasks.create_task(
        session, batch.tenant_id, spec, idempotency_key=key, request_hash=item.request_hash
    )
    deliveries += logged.deliveries
    if key:
        known[key] = logged.task
    return {"task_id": logged.task.id}, logged.task


def _key_reused(index: int, key: str | None) -> dict[str, Any]:
    field, pointer = f"tasks[{index}].idempotency_key", f"#/tasks/{index}/idempotency_key"
    reason = f"{key!r} was already used with a different task body"
    errors = [{"field": field, "pointer": pointer, "detail": reason}]
    return {"type": KEY_REUSED, "detail": f"{field}: {reason}", "errors": errors}
