"""A fenced write and everything that rides on it, described once and run by the backend
(``shared.store.backends``): as one statement on PostgreSQL, in turn elsewhere.

Each write of a step is a conditional UPDATE of the task row (the fence: it matches only while
the lease epoch holds) plus rows it brings along: events, webhook deliveries, the step's
checkpoint, ledger rows. They must happen together or not at all.

On PostgreSQL a batch is one statement (see ``shared.store.backends.postgresql``). Elsewhere
(SQLite, the embedded default) the same writes run one after another in the caller's transaction:
``run_in_turn`` below, whose inserts of events and deliveries are also those of every write
made outside a step (``shared.store.events.insert_events``).

Events take their seqs from the UPDATE's ``last_event_seq`` (the write reserved the last
``len(events)`` of them), so seqs come from the row, never from what the worker last saw.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Insert as InsertStatement
from sqlalchemy import (
    Row,
    Select,
    Table,
    insert,
    update,
)
from sqlalchemy import Update as UpdateStatement
from sqlalchemy.orm import Session

from shared.store import outbox
from shared.store.tables import TaskEvent, WebhookDelivery

EVENTS = cast(Table, TaskEvent.__table__)
DELIVERIES = cast(Table, WebhookDelivery.__table__)


@dataclass(frozen=True)
class Add:
    """A row to insert into ``table`` if the fence holds."""

    table: Table
    values: dict[str, Any]


@dataclass(frozen=True)
class Increment:
    """A value: add to the column."""

    by: float


@dataclass(frozen=True)
class Change:
    """An UPDATE of ``table`` rows of the same task (``where``: column == value), if the fence
    holds. Values may be ``Increment``."""

    table: Table
    where: dict[str, Any]
    values: dict[str, Any]


Part = Add | Change


@dataclass
class Batch:
    """``fence`` is an UPDATE of the task row returning ``id`` and ``last_event_seq`` (and
    whatever else the caller wants back), a SELECT … FOR NO KEY UPDATE of the same for a
    write that changes nothing of the row, or the INSERT of a new task returning the same;
    ``key`` names its shape for the statement cache."""

    fence: UpdateStatement | InsertStatement | Select[Any]
    key: Hashable
    params: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    deliveries: list[dict[str, Any]] = field(default_factory=list)  # "offset" names the event
    parts: list[Part] = field(default_factory=list)
    now: datetime | None = None
    first_delay_ms: int = 0
    tenant_id: str = ""
    # False: commit without waiting for the WAL flush (PostgreSQL's synchronous_commit off, for
    # this statement only). For a write whose loss in a database crash undoes nothing anyone
    # relied on; see take_lease. The next durable commit flushes it with its own.
    durable: bool = True


def run_in_turn(session: Session, batch: Batch) -> Row[Any] | None:
    """The batch as statements in turn, inside the caller's transaction: the fence first, and
    the rest only if it matched."""
    row = session.execute(batch.fence, batch.params).one_or_none()
    if row is None:
        return None
    insert_logged(
        session,
        task_id=row.id,
        tenant_id=batch.tenant_id,
        first_seq=row.last_event_seq - len(batch.events) + 1,
        events=batch.events,
        deliveries=batch.deliveries,
        now=batch.now,
    )
    for part in batch.parts:
        _run_part(session, row.id, part)
    return row


def insert_logged(
    session: Session,
    *,
    task_id: str,
    tenant_id: str,
    first_seq: int,
    events: Sequence[tuple[str, dict[str, Any]]],
    deliveries: Sequence[dict[str, Any]],
    now: datetime | None,
) -> None:
    """Insert ``events`` (seqs from ``first_seq`` on, reserved by the task row's update) and
    the outbox rows of their ``deliveries`` (each one's ``offset`` is its event's place, from
    1). Every write logs its events this way, but PostgreSQL's one-statement batch."""
    if events:
        session.execute(
            insert(EVENTS),
            [
                {"task_id": task_id, "seq": first_seq + i, "type": t, "data": d, "created_at": now}
                for i, (t, d) in enumerate(events)
            ],
        )
    if deliveries:
        session.execute(
            outbox.INSERT_DELIVERY,
            [
                outbox.record(
                    d, tenant_id=tenant_id, task_id=task_id, event_seq=first_seq + d["offset"] - 1
                )
                for d in deliveries
            ],
        )


def _run_part(session: Session, task_id: str, part: Part) -> None:
    table = part.table
    if isinstance(part, Add):
        session.execute(insert(table), part.values)
        return
    changes = {
        k: table.c[k] + v.by if isinstance(v, Increment) else v for k, v in part.values.items()
    }
    conditions = [table.c.task_id == task_id, *(table.c[k] == v for k, v in part.where.items())]
    session.execute(
        update(table)
        .where(*conditions)
        .values(changes)
        .execution_options(synchronize_session=False)
    )
