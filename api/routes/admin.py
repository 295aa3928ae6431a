"""Operator and admin views: ``/v1/admin/*`` is the operator's fleet-wide view (``operator``
scope): rate-limit buckets, and the concurrency limits in force with their use (changeable at
runtime, recorded with who and when); ``/v1/ratelimits`` shows a tenant admin its own
tenant's buckets and nothing else; ``/v1/schedules`` are a tenant's schedules."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Path, Query, Response
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from api import submission
from api.deps import Admin, Operator, Reader, SessionDep, Writer
from api.problems import responses
from api.schemas import TaskCreate
from shared.errors import InvalidRequest, NotFound
from shared.ratelimit.buckets import Bucket, LimiterUnavailable
from shared.ratelimit.limiter import get_limiter
from shared.ratelimit.limits import adaptive_share, configured_buckets, tenant_buckets
from shared.scheduling import admission, limits, schedules
from shared.settings import get_settings
from shared.store.tables import ConcurrencyLimit, Schedule

router = APIRouter(tags=["admin"])
# The schedules are a resource of their own in the OpenAPI document, not an operator's view.
schedule_router = APIRouter(tags=["schedules"])


def view(buckets: Sequence[Bucket], *, scope_prefix: str = "") -> dict[str, Any]:
    """Each bucket's capacity, level and last five minutes' decisions, waits and provider
    429s; plus the scopes (starting with ``scope_prefix``) a provider 429 has paused."""
    limiter = get_limiter()
    try:
        snapshot = limiter.snapshot(buckets)
        blocked = limiter.blocked()
        if get_settings().rate_limit_adaptive:  # the share its 429s have left each model
            for bucket in snapshot:
                scope = bucket["scope"]
                if scope.startswith("model:") and "*" not in scope:
                    bucket["adaptive_share"] = adaptive_share(scope.rsplit(":", 1)[0])
    except LimiterUnavailable as exc:
        raise HTTPException(503, str(exc)) from exc
    return {
        "buckets": snapshot,
        "blocked": [
            {"scope": s, "remaining_ms": ms}
            for s, ms in sorted(blocked.items())
            if s.startswith(scope_prefix)
        ],
    }


LIMITER_DOWN = responses(
    {503: "the database or the rate limiter (Redis) is unavailable; retry shortly"}
)


@router.get(
    "/v1/admin/ratelimits",
    summary="The fleet's rate-limit buckets (operator)",
    responses=LIMITER_DOWN,
)
def fleet_rate_limits(_: Operator) -> dict[str, Any]:
    """Every configured bucket of the fleet, every tenant's included (operator scope)."""
    return view(configured_buckets())


@router.get(
    "/v1/ratelimits", summary="The tenant's rate-limit buckets (admin)", responses=LIMITER_DOWN
)
def tenant_rate_limits(principal: Admin) -> dict[str, Any]:
    """The caller's tenant's own buckets (admin scope); never another tenant's."""
    name = principal.tenant_name
    return view(tenant_buckets(name), scope_prefix=f"tenant:{name}:")


# --- scheduling: concurrency limits (operator) and schedules (a tenant's) ------------


KindPath = Annotated[
    Literal["tenants", "agents", "pools"], Path(description="what the limit applies to")
]
NamePath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=200,
        description="the tenant's name, the agent, the pool's name, or `*` (every tenant, "
        "every agent)",
    ),
]


class LimitOut(BaseModel):
    kind: str
    name: str
    spec: dict[str, Any]
    source: Literal["runtime", "configuration"]
    updated_by: str | None = None
    updated_at: datetime | None = None


class Usage(BaseModel):
    running: int = Field(description="admitted now: running, or its message on the way")
    waiting: int = Field(0, description="in the backlog (tenants only)")
    queued: int = Field(0, description="of those waiting, how many never started (tenants only)")


class ConcurrencyView(BaseModel):
    fair_scheduling: bool
    limits: list[LimitOut]
    tenants: dict[str, Usage]
    agents: dict[str, Usage]
    pools: dict[str, Usage]
    admitted: int = Field(description="tasks admitted fleet-wide")
    in_queue: int = Field(description="of which still a message in the broker")


def _limit_out(kind: str, name: str, spec: Any, row: ConcurrencyLimit | None) -> LimitOut:
    return LimitOut(
        kind=kind,
        name=name,
        spec=spec.model_dump(),
        source="runtime" if row is not None else "configuration",
        updated_by=row.updated_by if row else None,
        updated_at=row.updated_at.replace(tzinfo=row.updated_at.tzinfo or UTC) if row else None,
    )


@router.get(
    "/v1/admin/concurrency",
    response_model=ConcurrencyView,
    summary="Concurrency limits in force and their use (operator)",
)
def concurrency_view(_: Operator, session: SessionDep) -> ConcurrencyView:
    """Every limit (from the configuration, or set at runtime), and what each tenant, agent
    and pool holds now; tenants also with their backlog."""
    return read_concurrency(session)


def read_concurrency(session: Session) -> ConcurrencyView:
    """The operator's view of the limits and their use (the API's and the dashboard's)."""
    with session.begin():
        in_force = limits.in_force(session)
        rows = {(r.kind, r.name): r for r in session.query(ConcurrencyLimit).all()}
        use = admission.in_use(session, in_force)
        backlog = admission.backlog_by_tenant(session)
    out = [
        _limit_out(kind, name, spec, rows.get((kind, name)))
        for kind in limits.KINDS
        for name, spec in sorted(getattr(in_force.config, kind).items())
    ]
    tenant_names = set(use.tenants) | set(backlog)
    return ConcurrencyView(
        fair_scheduling=get_settings().fair_scheduling,
        limits=out,
        tenants={
            name: Usage(
                running=use.tenants[name],
                waiting=backlog.get(name, (0, 0))[0],
                queued=backlog.get(name, (0, 0))[1],
            )
            for name in sorted(tenant_names)
        },
        agents={name: Usage(running=n) for name, n in sorted(use.agents.items())},
        pools={name: Usage(running=use.pools[name]) for name in sorted(in_force.config.pools)},
        admitted=use.total,
        in_queue=use.in_queue,
    )


@router.put(
    "/v1/admin/concurrency/{kind}/{name}",
    response_model=LimitOut,
    summary="Set a concurrency limit at runtime (operator)",
    responses=responses({422: "the limit is not valid for its kind (``errors`` names the field)"}),
)
def set_limit(
    kind: KindPath, name: NamePath, spec: dict[str, Any], principal: Operator, session: SessionDep
) -> LimitOut:
    """Overrides the configured limit of the same kind and name (the whole entry) for the
    whole fleet, within a second. Tenants: ``max_running``, ``max_queued``, ``weight``;
    agents: ``max_running``; pools: ``max_running`` and the ``models``, ``agents`` and
    ``tenants`` patterns they hold."""
    with session.begin():
        row = limits.set_override(
            session, kind, name, spec, by=f"key:{principal.key_id} ({principal.tenant_name})"
        )
        model = limits.SPECS[kind].model_validate(row.spec)
        return _limit_out(kind, name, model, row)


@router.delete(
    "/v1/admin/concurrency/{kind}/{name}",
    status_code=204,
    summary="Remove a runtime concurrency limit (operator)",
    responses=responses({404: "no limit of that kind and name was set at runtime"}),
)
def delete_limit(kind: KindPath, name: NamePath, _: Operator, session: SessionDep) -> Response:
    """The configured limit (if any) applies again."""
    with session.begin():
        if not limits.delete_override(session, kind, name):
            raise NotFound(f"no runtime limit for {kind} {name!r}")
    return Response(status_code=204)


# --- schedules ----------------------------------------------------------------------------


class ScheduleCreate(BaseModel):
    model_config = {"extra": "forbid"}

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    cron: str = Field(
        min_length=9,
        max_length=200,
        pattern=r"^[0-9*/,-]+( [0-9*/,-]+){4,5}$",
        description="minute hour day month weekday, and optionally a sixth field, the last: "
        "the second (`* * * * * 30` is once a minute, `*/5 * * * * *` every second of every "
        "fifth minute). Two ticks are at least `RATCHET_SCHEDULE_MIN_INTERVAL_SECONDS` apart "
        "(60 by default)",
        examples=["0 9 * * 1-5"],
    )
    timezone: str = Field("UTC", max_length=64, description="an IANA time zone")
    task: TaskCreate = Field(description="the task submitted at every tick (as POST /v1/tasks)")
    catch_up: Literal["run_once", "skip"] = Field(
        "run_once",
        description="ticks missed while the fleet was down: run the latest once, or skip",
    )


class ScheduleOut(BaseModel):
    id: str
    name: str
    cron: str
    timezone: str
    catch_up: str
    paused: bool
    next_fire_at: datetime | None
    last_fired_at: datetime | None
    last_task_id: str | None
    fired: int
    skipped: int
    last_error: str | None
    task: dict[str, Any]
    created_at: datetime


class ScheduleList(BaseModel):
    items: list[ScheduleOut]
    next_cursor: str | None = Field(None, description="the next page's ``cursor``; null: none")


def _at(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=UTC)


def schedule_out(schedule: Schedule) -> ScheduleOut:
    return ScheduleOut(
        id=schedule.id,
        name=schedule.name,
        cron=schedule.cron,
        timezone=schedule.timezone,
        catch_up=schedule.catch_up,
        paused=schedule.paused,
        next_fire_at=None if schedule.paused else _at(schedule.next_fire_ms),
        last_fired_at=_at(schedule.last_fired_ms),
        last_task_id=schedule.last_task_id,
        fired=schedule.fired,
        skipped=schedule.skipped,
        last_error=schedule.last_error,
        task=schedule.body["request"],
        created_at=schedule.created_at.replace(tzinfo=schedule.created_at.tzinfo or UTC),
    )


SCHEDULE_404 = responses({404: "no such schedule (another tenant's is not found either)"})


@schedule_router.post(
    "/v1/schedules",
    status_code=201,
    response_model=ScheduleOut,
    summary="Create a schedule",
    responses=responses(
        {
            409: "the tenant has a schedule of that name, or as many schedules as it may have",
            422: "the body is invalid: a bad cron expression (or one firing more often than "
            "the minimum interval), time zone or task (or a task larger than a schedule's "
            "may be)",
        }
    ),
)
def create_schedule(
    body: ScheduleCreate, principal: Writer, session: SessionDep, response: Response
) -> ScheduleOut:
    """Submits ``task`` at every tick of ``cron`` in ``timezone``, once per tick across the
    fleet (each tick's task has the idempotency key ``schedule:<id>:<tick ms>``)."""
    if body.task.run_at is not None or body.task.delay_seconds is not None:
        field = "task.run_at" if body.task.run_at is not None else "task.delay_seconds"
        raise InvalidRequest(field, "a schedule's task runs at its ticks")
    schedules.check_cron(body.cron, body.timezone)
    spec = submission.resolve(body.task, get_settings())
    with session.begin():
        schedule = schedules.create(
            session,
            principal.tenant_id,
            name=body.name,
            cron=body.cron,
            timezone=body.timezone,
            spec=spec,
            request=body.task.model_dump(mode="json", exclude_defaults=True),
            catch_up=body.catch_up,
            created_by=f"key:{principal.key_id}",
        )
        out = schedule_out(schedule)
    response.headers["Location"] = f"/v1/schedules/{out.id}"
    return out


@schedule_router.get(
    "/v1/schedules", response_model=ScheduleList, summary="List the tenant's schedules"
)
def list_schedules(
    principal: Reader,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=100, description="at most this many")] = 50,
    cursor: Annotated[
        str | None,
        Query(
            max_length=100,
            pattern=r"^[^\x00-\x1f\x7f]+$",  # any name, as the command line allows any
            description="``next_cursor`` of the page before (the last name it listed)",
        ),
    ] = None,
) -> ScheduleList:
    """The caller's tenant's schedules, by name, a page at a time. A page's cursor is the name
    it ends with: names are unique in a tenant, and any name is a cursor (none is refused)."""
    after = cursor or None
    with session.begin():
        rows = schedules.list_for(session, principal.tenant_id, after=after, limit=limit + 1)
        items = [schedule_out(s) for s in rows[:limit]]
    more = len(rows) > limit
    return ScheduleList(items=items, next_cursor=items[-1].name if more else None)


@schedule_router.get(
    "/v1/schedules/{schedule_id}",
    response_model=ScheduleOut,
    summary="Read a schedule",
    responses=SCHEDULE_404,
)
def get_schedule(schedule_id: str, principal: Reader, session: SessionDep) -> ScheduleOut:
    """One of the tenant's schedules: its next and last tick, and what it fired."""
    with session.begin():
        return schedule_out(schedules.get(session, principal.tenant_id, schedule_id))


@schedule_router.post(
    "/v1/schedules/{schedule_id}/pause",
    response_model=ScheduleOut,
    summary="Pause a schedule",
    responses=SCHEDULE_404,
)
def pause_schedule(schedule_id: str, principal: Writer, session: SessionDep) -> ScheduleOut:
    """No tick fires while it is paused (ticks missed meanwhile are not run)."""
    return _set_paused(session, principal.tenant_id, schedule_id, paused=True)


@schedule_router.post(
    "/v1/schedules/{schedule_id}/resume",
    response_model=ScheduleOut,
    summary="Resume a schedule",
    responses=SCHEDULE_404,
)
def resume_schedule(schedule_id: str, principal: Writer, session: SessionDep) -> ScheduleOut:
    """It fires again from its next tick after now."""
    return _set_paused(session, principal.tenant_id, schedule_id, paused=False)


def _set_paused(session: Session, tenant_id: str, schedule_id: str, *, paused: bool) -> ScheduleOut:
    with session.begin():
        schedule = schedules.get(session, tenant_id, schedule_id)
        return schedule_out(schedules.set_paused(session, schedule, paused))


@schedule_router.delete(
    "/v1/schedules/{schedule_id}",
    status_code=204,
    summary="Delete a schedule",
    responses=SCHEDULE_404,
)
def delete_schedule(schedule_id: str, principal: Writer, session: SessionDep) -> Response:
    """Tasks it fired already are not touched."""
    with session.begin():
        session.delete(schedules.get(session, principal.tenant_id, schedule_id))
    return Response(status_code=204)
