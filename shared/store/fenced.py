"""The fenced write's parts: the task row's columns, the prediction of what a write leaves
it as, the SET clause compiled from a write's shape, and the events and webhook deliveries
that ride in the same statement. ``writes`` and ``leases`` build their statements from these."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

from sqlalchemy import BigInteger, ColumnElement, Table, bindparam, or_
from sqlalchemy.orm import Session

from shared.statuses import RUNNABLE_STATUSES, in_order
from shared.store import outbox
from shared.store.batch import Batch, Increment
from shared.store.db import now_ms
from shared.store.tables import Task
from shared.views import TaskState

# A task row as a write returns it: every column, "metadata" under its attribute name.
TASK_COLUMNS = [c.label("meta") if c.name == "metadata" else c for c in Task.__table__.columns]


TASKS = cast(Table, Task.__table__)


FIELDS = [column.name for column in TASK_COLUMNS]  # a TaskState's attributes


EventSpec = tuple[str, dict[str, Any] | Callable[[TaskState], dict[str, Any]]]


@dataclass(frozen=True)
class FromNow:
    """A value for write(): the database clock plus ``ms`` (epoch milliseconds)."""

    ms: int


def state_of(task: TaskState) -> SimpleNamespace:
    """A copy of ``task`` (an ORM Task, a row or a state) that ``predict`` may change."""
    return SimpleNamespace(**{name: getattr(task, name) for name in FIELDS})


def predict(task: TaskState, changes: dict[str, Any]) -> TaskState:
    """The row as a write of ``changes`` leaves it. Exact for a fenced write: only the lease
    holder changes the columns a Task document shows, and it knows the row it leased. Values
    on the database's clock stay ``FromNow`` until ``settle`` puts the clock in."""
    state = state_of(task)
    for key, value in changes.items():
        if isinstance(value, Increment):
            setattr(state, key, getattr(state, key) + value.by)
        else:
            setattr(state, key, value)
    return cast(TaskState, state)


BIGINT = 2**63  # the task row's counters are BIGINT columns


def check_in_range(state: TaskState, changes: dict[str, Any]) -> None:
    """Refuse a write that would take a counter past its column's range, as PostgreSQL would
    (SQLite would store a float instead, and the row could no longer be read)."""
    for key in changes:
        value = getattr(state, key)
        if type(value) is int and not -BIGINT <= value < BIGINT:
            raise ValueError(f"{key} out of range: {value}")


def settle(state: TaskState, row: Any) -> None:
    """Put what only the database knew (its clock, the event seq) into a predicted state."""
    fixed = cast(SimpleNamespace, state)
    fixed.last_event_seq = row.last_event_seq
    for key in ("lease_expires_ms", "due_ms"):
        if isinstance(getattr(fixed, key), FromNow):
            setattr(fixed, key, row.clock_ms + getattr(fixed, key).ms)


def runnable(status: ColumnElement[str]) -> ColumnElement[bool]:
    """``status IN (…)`` spelled with OR: an IN list is expanded at each execution, which a
    statement compiled once (backend.fetch_one) cannot have."""
    return or_(*(status == value for value in in_order(RUNNABLE_STATUSES)))


def _kind(value: Any) -> str:
    return "inc" if isinstance(value, Increment) else "now" if isinstance(value, FromNow) else "set"


def _param(value: Any) -> Any:
    if isinstance(value, Increment):
        return value.by
    return value.ms if isinstance(value, FromNow) else value


def shape_of(changes: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((key, _kind(value)) for key, value in changes.items()))


def params_of(changes: dict[str, Any]) -> dict[str, Any]:
    return {f"b_{key}": _param(value) for key, value in changes.items()}


def assignments(shape: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """The SET clause of a write of this shape, its values bound as ``b_<column>``."""
    c = TASKS.c
    changes: dict[str, Any] = {}
    for key, kind in shape:
        column = c[key]
        if kind == "inc":
            changes[key] = column + bindparam(f"b_{key}", type_=column.type)
        elif kind == "now":
            changes[key] = now_ms() + bindparam(f"b_{key}", type_=BigInteger)
        else:
            changes[key] = bindparam(f"b_{key}", type_=column.type)
    return changes


MODEL_RESPONSE = "step.model_response"
TOOL_CALL = "step.tool_call"
OUTCOME_KEYS = frozenset(("step", "call_id", "name", "status", "result", "error"))


def stored_form(type_: str, data: dict[str, Any]) -> dict[str, Any]:
    """What the event log's row holds of an event: a ``step.model_response`` names its step
    alone, whose checkpoint row holds the answer and its usage; a call's outcome names its
    call alone, whose ledger row holds the outcome (each row written in the same statement
    as the event, and never changed after). Reads put the rest back (``events.list_events``);
    webhooks carry the event whole. Every other event is stored as it is."""
    if type_ == MODEL_RESPONSE:
        return {"step": data["step"]}
    if type_ == TOOL_CALL and data.keys() == OUTCOME_KEYS:  # not a decision's event
        return {"step": data["step"], "call_id": data["call_id"]}
    return data


def names_step(type_: str, data: dict[str, Any]) -> bool:
    """A model response stored by :func:`stored_form` (older rows hold it whole)."""
    return type_ == MODEL_RESPONSE and data.keys() == {"step"}


def names_call(type_: str, data: dict[str, Any]) -> bool:
    """A call's outcome stored by :func:`stored_form` (older rows hold it whole)."""
    return type_ == TOOL_CALL and data.keys() == {"step", "call_id"}


def log_in_batch(
    session: Session, to: Batch, events: Sequence[EventSpec], *, task: TaskState
) -> None:
    """Add ``events`` (the last seqs the fence reserves) and their webhooks to a batch;
    ``task`` is the row as the fence leaves it, which events built from the task carry."""
    resolved = [(type_, spec(task) if callable(spec) else spec) for type_, spec in events]
    to.events = [(type_, stored_form(type_, data)) for type_, data in resolved]
    to.tenant_id = task.tenant_id
    subscriptions = outbox.subscriptions_for(session, task)
    if subscriptions:
        offsets = [(i, type_, data) for i, (type_, data) in enumerate(resolved, 1)]
        to.deliveries = outbox.delivery_rows(subscriptions, offsets, task_id=task.id)
        to.first_delay_ms = outbox.first_delay_ms()
