"""``/v1/schedules``: a tenant's schedules — tasks submitted on a cron expression in a time
zone — created, listed, read, paused, resumed and deleted."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Response

from api import submission
from api.deps import Reader, SessionDep, Writer
from api.problems import responses
from api.schemas.schedules import ScheduleCreate, ScheduleList, ScheduleOut
from shared.actions import schedules as schedule_actions
from shared.errors import InvalidRequest
from shared.scheduling import schedules
from shared.settings import get_settings
from shared.store.tables import Schedule

# The schedules are a resource of their own in the OpenAPI document, not an operator's view.
router = APIRouter(tags=["schedules"])


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


@router.post(
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
    spec = submission.resolve(body.task, get_settings(), tenant_id=principal.tenant_id)
    schedule = schedule_actions.create(
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


@router.get("/v1/schedules", response_model=ScheduleList, summary="List the tenant's schedules")
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


@router.get(
    "/v1/schedules/{schedule_id}",
    response_model=ScheduleOut,
    summary="Read a schedule",
    responses=SCHEDULE_404,
)
def get_schedule(schedule_id: str, principal: Reader, session: SessionDep) -> ScheduleOut:
    """One of the tenant's schedules: its next and last tick, and what it fired."""
    with session.begin():
        return schedule_out(schedules.get(session, principal.tenant_id, schedule_id))


@router.post(
    "/v1/schedules/{schedule_id}/pause",
    response_model=ScheduleOut,
    summary="Pause a schedule",
    responses=SCHEDULE_404,
)
def pause_schedule(schedule_id: str, principal: Writer, session: SessionDep) -> ScheduleOut:
    """No tick fires while it is paused (ticks missed meanwhile are not run)."""
    paused = schedule_actions.pause(session, principal.tenant_id, schedule_id, paused=True)
    return schedule_out(paused)


@router.post(
    "/v1/schedules/{schedule_id}/resume",
    response_model=ScheduleOut,
    summary="Resume a schedule",
    responses=SCHEDULE_404,
)
def resume_schedule(schedule_id: str, principal: Writer, session: SessionDep) -> ScheduleOut:
    """It fires again from its next tick after now."""
    resumed = schedule_actions.pause(session, principal.tenant_id, schedule_id, paused=False)
    return schedule_out(resumed)


@router.delete(
    "/v1/schedules/{schedule_id}",
    status_code=204,
    summary="Delete a schedule",
    responses=SCHEDULE_404,
)
def delete_schedule(schedule_id: str, principal: Writer, session: SessionDep) -> Response:
    """Tasks it fired already are not touched."""
    schedule_actions.delete(session, principal.tenant_id, schedule_id)
    return Response(status_code=204)
