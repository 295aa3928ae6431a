"""Finding tasks by what an operator knows about them: tenant, state, agent, model, a
metadata ``key:value``, a time range or an id. Pages are keyset-paginated on the id (newest
first), so a page costs the same however deep it is; bulk actions take every match, up to a
cap, in the same order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from shared.errors import InvalidRequest
from shared.statuses import TaskStatus
from shared.store.tables import Task, Tenant

BULK_LIMIT = 10_000  # tasks one bulk action may change


@dataclass(frozen=True)
class TaskFilter:
    """What a task list shows; every field is optional and they combine with AND."""

    tenant: str | None = None  # a tenant's name (the operator's view only)
    status: str | None = None
    agent: str | None = None
    model: str | None = None
    metadata: str | None = None  # "key:value"
    error: str | None = None  # a failed task's error type
    created_after: datetime | None = None
    created_before: datetime | None = None
    id: str | None = None

    def __post_init__(self) -> None:
        if self.status and self.status not in tuple(TaskStatus):
            raise InvalidRequest("status", f"is one of {', '.join(TaskStatus)}")
        if self.metadata and ":" not in self.metadata:
            raise InvalidRequest("metadata", "filter as key:value")

    def as_params(self) -> dict[str, str]:
        """The filter as query parameters, for links that keep it."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {
            name: value.isoformat() if isinstance(value, datetime) else str(value)
            for name, value in values.items()
            if value not in (None, "")
        }


def _query(tenant_id: str | None, where: TaskFilter) -> Select[Any]:
    query = select(Task)
    if tenant_id is not None:
        query = query.where(Task.tenant_id == tenant_id)
    if where.tenant:
        query = query.join(Tenant, Tenant.id == Task.tenant_id).where(Tenant.name == where.tenant)
    for column, value in (
        (Task.id, where.id),
        (Task.status, where.status),
        (Task.agent, where.agent),
        (Task.model, where.model),
    ):
        if value:
            query = query.where(column == value)
    if where.error:
        query = query.where(Task.error["type"].as_string() == where.error)
    if where.metadata:
        key, _, value = where.metadata.partition(":")
        query = query.where(Task.meta[key.strip()].as_string() == value.strip())
    if where.created_after:
        query = query.where(Task.created_at >= where.created_after)
    if where.created_before:
        query = query.where(Task.created_at < where.created_before)
    return query


def search(
    session: Session,
    tenant_id: str | None,
    where: TaskFilter,
    *,
    limit: int = 50,
    after_id: str | None = None,
) -> tuple[Sequence[Task], str | None]:
    """A page of matching tasks, newest first, and the id to continue after (or None).
    ``tenant_id=None`` searches every tenant (the operator's view)."""
    query = _query(tenant_id, where)
    if after_id:
        query = query.where(Task.id < after_id)
    rows = session.scalars(query.order_by(Task.id.desc()).limit(limit + 1)).all()
    more = len(rows) > limit
    return rows[:limit], (rows[limit - 1].id if more else None)


def matching_ids(
    session: Session, tenant_id: str | None, where: TaskFilter, *, status: Sequence[str]
) -> list[tuple[str, str]]:
    """(tenant id, task id) of every match in one of ``status``, newest first, at most
    :data:`BULK_LIMIT`: what a bulk action on "everything matching" changes."""
    query = _query(tenant_id, where).where(Task.status.in_(status))
    ids = query.with_only_columns(Task.tenant_id, Task.id).order_by(Task.id.desc())
    return [(t, i) for t, i in session.execute(ids.limit(BULK_LIMIT)).tuples()]


def tenant_names(session: Session, tenant_ids: Sequence[str]) -> dict[str, str]:
    rows = session.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(set(tenant_ids))))
    return dict(rows.tuples().all())
