"""The dashboard's numbers as JSON: ``/v1/overview`` is a tenant admin's view of its own
tenant, ``/v1/admin/overview`` the operator's view of the fleet (or of one tenant), and
``/v1/admin/tasks`` the operator's task search across tenants. Each reads only bounded
time windows through indexes (see ``shared.ops.overview``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query

from api import params
from api.deps import Admin, Operator, SessionDep
from api.params import cursor_after
from api.problems import responses
from api.schemas.overview import Overview
from api.schemas.tasks import TaskList
from shared.ops import overview, search
from shared.ops.search import TaskFilter
from shared.store.tenants import get_tenant_by_name
from shared.views import task_view

router = APIRouter(tags=["admin"])
Window = Annotated[Literal["1h", "24h"], Query(description="the last hour or the last day")]


def _read(session: SessionDep, tenant_id: str | None, window: str) -> Overview:
    with session.begin():
        return Overview.model_validate(overview.overview(session, tenant_id, window=window))


@router.get("/v1/overview", response_model=Overview, summary="The tenant's overview (admin)")
def tenant_overview(principal: Admin, session: SessionDep, window: Window = "1h") -> Overview:
    """Tasks by state, per-minute or per-hour counts, latency percentiles, usage and errors
    of the caller's own tenant."""
    return _read(session, principal.tenant_id, window)


@router.get(
    "/v1/admin/overview",
    response_model=Overview,
    summary="The fleet's overview (operator)",
    responses=responses({404: "no tenant of that name"}),
)
def fleet_overview(
    _: Operator,
    session: SessionDep,
    window: Window = "1h",
    tenant: Annotated[str | None, Query(max_length=100, description="one tenant's")] = None,
) -> Overview:
    """The same numbers for every tenant together, or for the tenant named."""
    with session.begin():
        tenant_id = get_tenant_by_name(session, tenant).id if tenant else None
    return _read(session, tenant_id, window)


@router.get("/v1/admin/tasks", response_model=TaskList, summary="Search every tenant's tasks")
def search_tasks(
    _: Operator,
    session: SessionDep,
    tenant: Annotated[str | None, Query(max_length=100)] = None,
    status: Annotated[str | None, Query(max_length=32)] = None,
    agent: Annotated[str | None, Query(max_length=100)] = None,
    model: Annotated[str | None, Query(max_length=200)] = None,
    metadata: Annotated[str | None, Query(max_length=300, description="key:value")] = None,
    error: Annotated[str | None, Query(max_length=100, description="an error type")] = None,
    created_after: datetime | None = None,
    created_before: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
) -> TaskList:
    """Tasks of every tenant (operator scope), newest first, by any combination of filters."""
    where = TaskFilter(
        tenant=tenant,
        status=status,
        agent=agent,
        model=model,
        metadata=metadata,
        error=error,
        created_after=created_after,
        created_before=created_before,
    )
    with session.begin():
        rows, last = search.search(session, None, where, limit=limit, after_id=cursor_after(cursor))
        items = [task_view(t) for t in rows]
    return TaskList(items=items, next_cursor=params.next_cursor(last))
