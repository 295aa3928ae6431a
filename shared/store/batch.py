"""A fenced write and everything that rides on it, sent as one statement where the database
allows.

Each write of a step is a conditional UPDATE of the task row (the fence: it matches only while
the lease epoch holds) plus rows it brings along: events, webhook deliveries, the step's
checkpoint, ledger rows. They must happen together or not at all.

On PostgreSQL a batch is one statement: the UPDATE in a CTE and every other write selecting
from it, so each happens only if the fence matched. Sent on an autocommit connection, it costs
one round trip and one commit, where a transaction of separate statements costs a round trip
for BEGIN, one per statement and one for COMMIT. Elsewhere (SQLite, the embedded default) the
same writes run one after another inside the caller's transaction.

Events take their seqs from the UPDATE's ``last_event_seq`` (the write reserved the last
``len(events)`` of them), so seqs come from the row, never from what the worker last saw.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Integer,
    Row,
    Select,
    Table,
    Text,
    column,
    func,
    insert,
    literal,
    select,
    true,
    update,
)
from sqlalchemy import Update as UpdateStatement
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session
from sqlalchemy.sql import bindparam

from shared.store import db, outbox
from shared.store.db import now_ms
from shared.store.tables import TaskEvent, WebhookDelivery

_EVENTS = cast(Table, TaskEvent.__table__)
_DELIVERIES = cast(Table, WebhookDelivery.__table__)


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
    whatever else the caller wants back); ``key`` names its shape for the statement cache."""

    fence: UpdateStatement
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


def run(session: Session, batch: Batch) -> Row[Any] | None:
    """Execute the batch; returns the fence's row, or None (then nothing was written)."""
    if session.get_bind().dialect.name == "postgresql":
        return _run_as_one(session, batch)
    return _run_in_turn(session, batch)


# --- PostgreSQL: one statement ---------------------------------------------------------------


def _part_shape(part: Part) -> Hashable:
    if isinstance(part, Add):
        return ("add", part.table.name, tuple(part.values))
    kinds = tuple((k, isinstance(v, Increment)) for k, v in part.values.items())
    return ("change", part.table.name, tuple(part.where), kinds)


_statements: dict[Hashable, Select[Any]] = {}


def _run_as_one(session: Session, batch: Batch) -> Row[Any] | None:
    shape: tuple[Hashable, ...] = (batch.key, batch.durable, bool(batch.events))
    shape += (bool(batch.deliveries),)
    shape += tuple(_part_shape(part) for part in batch.parts)
    statement = _statements.get(shape)
    if statement is None:
        statement = _statements[shape] = _compose(batch)
    params = dict(batch.params)
    if batch.events:
        params |= {
            "x_events": [
                {"offset": i, "type": type_, "data": data}
                for i, (type_, data) in enumerate(batch.events, 1)
            ],
            "x_count": len(batch.events),
            "x_now": batch.now,
        }
    if batch.deliveries:
        params |= {
            "x_deliveries": batch.deliveries,
            "x_first_delay_ms": batch.first_delay_ms,
            "x_tenant_id": batch.tenant_id,
            "x_now": batch.now,
        }
    for index, part in enumerate(batch.parts):
        params |= _part_params(index, part)
    return cast(Row[Any] | None, db.fetch_one(session, statement, params))


def _part_params(index: int, part: Part) -> dict[str, Any]:
    params = {f"p{index}_{k}": _plain(v) for k, v in part.values.items()}
    if isinstance(part, Change):
        params |= {f"p{index}_w_{k}": v for k, v in part.where.items()}
    return params


def _plain(value: Any) -> Any:
    return value.by if isinstance(value, Increment) else value


def _recordset(name: str, param: str, columns: Sequence[tuple[str, Any]]) -> Any:
    return (
        func.jsonb_to_recordset(bindparam(param, type_=JSONB))
        .table_valued(*(column(n, t) for n, t in columns))
        .render_derived(name=name, with_types=True)
    )


def _compose(batch: Batch) -> Select[Any]:
    """The batch's statement: ``WITH w AS (UPDATE … RETURNING …), … SELECT * FROM w``."""
    w = batch.fence.cte("w")
    ctes = []
    if batch.events:
        e = _recordset("e", "x_events", [("offset", Integer), ("type", Text), ("data", JSONB)])
        rows = select(
            w.c.id,
            w.c.last_event_seq - bindparam("x_count", type_=Integer) + e.c.offset,
            e.c.type,
            e.c.data,
            bindparam("x_now"),
        ).select_from(w.join(e, true()))
        ctes.append(
            insert(_EVENTS)
            .from_select(["task_id", "seq", "type", "data", "created_at"], rows)
            .cte("e_ins")
        )
    if batch.deliveries:
        ctes.append(_deliveries_cte(w))
    for index, part in enumerate(batch.parts):
        ctes.append(_part_cte(w, index, part))
    if batch.durable:
        return select(w).add_cte(*ctes)
    # set_config(…, true) is SET LOCAL: it lasts until this statement's own commit.
    lazy = select(func.set_config("synchronous_commit", "off", True).label("lazy")).cte("lazy")
    return select(w).join_from(w, lazy, true()).add_cte(*ctes)


def _deliveries_cte(w: Any) -> Any:
    d = _recordset(
        "d",
        "x_deliveries",
        [
            ("id", Text),
            ("endpoint_id", Text),
            ("offset", Integer),
            ("event_type", Text),
            ("url", Text),
            ("payload", JSONB),
        ],
    )
    rows = select(
        d.c.id,
        bindparam("x_tenant_id"),
        w.c.id,
        d.c.endpoint_id,
        w.c.last_event_seq - bindparam("x_count", type_=Integer) + d.c.offset,
        d.c.event_type,
        d.c.url,
        d.c.payload,
        literal("pending"),
        literal(0),
        literal(0),
        now_ms() + bindparam("x_first_delay_ms", type_=BigInteger),
        bindparam("x_now"),
    ).select_from(w.join(d, true()))
    columns = [
        "id",
        "tenant_id",
        "task_id",
        "endpoint_id",
        "event_seq",
        "event_type",
        "url",
        "payload",
        "status",
        "attempts",
        "attempts_base",
        "next_attempt_ms",
        "created_at",
    ]
    return insert(_DELIVERIES).from_select(columns, rows).cte("d_ins")


def _part_cte(w: Any, index: int, part: Part) -> Any:
    table = part.table
    if isinstance(part, Add):
        values = [bindparam(f"p{index}_{k}", type_=table.c[k].type) for k in part.values]
        rows = select(*values).select_from(w)
        return insert(table).from_select(list(part.values), rows).cte(f"p{index}")
    conditions: list[ColumnElement[bool]] = [table.c.task_id == w.c.id]
    conditions += [table.c[k] == bindparam(f"p{index}_w_{k}") for k in part.where]
    changes: dict[str, Any] = {}
    for key, value in part.values.items():
        param = bindparam(f"p{index}_{key}", type_=table.c[key].type)
        changes[key] = table.c[key] + param if isinstance(value, Increment) else param
    return update(table).where(*conditions).values(changes).cte(f"p{index}")


# --- elsewhere: in turn, inside the caller's transaction --------------------------------------


def _run_in_turn(session: Session, batch: Batch) -> Row[Any] | None:
    row = session.execute(batch.fence, batch.params).one_or_none()
    if row is None:
        return None
    first = row.last_event_seq - len(batch.events) + 1
    if batch.events:
        session.execute(
            insert(_EVENTS),
            [
                {"task_id": row.id, "seq": first + i, "type": t, "data": d, "created_at": batch.now}
                for i, (t, d) in enumerate(batch.events)
            ],
        )
    if batch.deliveries:
        session.execute(
            outbox.INSERT_DELIVERY,
            [
                outbox.record(
                    d, tenant_id=batch.tenant_id, task_id=row.id, event_seq=first + d["offset"] - 1
                )
                for d in batch.deliveries
            ],
        )
    for part in batch.parts:
        _run_part(session, row.id, part)
    return row


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
