"""Schedules: a task body submitted on a cron expression in a time zone.

The dispatcher fires them (one dispatcher leads the fleet at a time). Each tick is fired in
one transaction that locks the schedule's row, creates the tick's task with the idempotency
key ``schedule:<id>:<tick>`` and moves ``next_fire_ms`` on, conditional on the tick it read:
so a tick fires once, whichever dispatcher, crash or failover. A tick later than
``RATCHET_SCHEDULE_MISFIRE_GRACE_SECONDS`` (the fleet was down) is missed; the schedule's
``catch_up`` policy then runs the latest missed tick once (``run_once``) or skips them all
(``skip``), and the schedule goes on from the next tick after now.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadCronError, CroniterBadDateError, croniter
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.errors import Conflict, InvalidRequest, NotFound
from shared.ids import new_id
from shared.store import tasks
from shared.store.db import now_ms
from shared.store.tables import Schedule

log = logging.getLogger("ratchet.schedules")
CATCH_UP = ("run_once", "skip")
MAX_CATCH_UP_STEPS = 100_000  # ticks looked through to find the latest one missed


def check_cron(expression: str, timezone: str) -> ZoneInfo:
    """The time zone, once the expression and the zone are known good (InvalidRequest)."""
    try:
        zone = ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidRequest("timezone", f"unknown time zone {timezone!r}") from None
    if not croniter.is_valid(expression) or len(expression.split()) not in (5, 6):
        raise InvalidRequest(
            "cron", "must be a cron expression: minute hour day month weekday [second]"
        )
    return zone


def next_tick(expression: str, timezone: str, after_ms: int) -> int:
    """The first tick strictly after ``after_ms`` (epoch ms), in the schedule's zone (a sixth
    field, if given, is the second)."""
    zone = ZoneInfo(timezone)
    start = datetime.fromtimestamp(after_ms / 1000, tz=UTC).astimezone(zone)
    try:
        tick = croniter(expression, start, second_at_beginning=False).get_next(datetime)
    except (CroniterBadCronError, CroniterBadDateError) as exc:
        raise InvalidRequest("cron", str(exc)) from None
    return int(tick.timestamp() * 1000)


def create(
    session: Session,
    tenant_id: str,
    *,
    name: str,
    cron: str,
    timezone: str,
    spec: tasks.NewTask,
    request: dict[str, Any],
    catch_up: str,
    created_by: str,
) -> Schedule:
    check_cron(cron, timezone)
    clock = int(session.scalar(select(now_ms())) or 0)
    schedule = Schedule(
        id=new_id(),
        tenant_id=tenant_id,
        name=name,
        cron=cron,
        timezone=timezone,
        body={"request": request, "spec": dataclasses.asdict(spec)},
        catch_up=catch_up,
        paused=False,
        next_fire_ms=next_tick(cron, timezone, clock),
        fired=0,
        skipped=0,
        created_by=created_by,
    )
    session.add(schedule)
    try:
        session.flush()
    except IntegrityError:
        raise Conflict(f"this tenant already has a schedule named {name!r}") from None
    return schedule


def get(session: Session, tenant_id: str, schedule_id: str) -> Schedule:
    schedule = session.scalar(
        select(Schedule).where(Schedule.id == schedule_id, Schedule.tenant_id == tenant_id)
    )
    if schedule is None:
        raise NotFound(f"no schedule {schedule_id}")
    return schedule


def list_for(session: Session, tenant_id: str) -> Sequence[Schedule]:
    return session.scalars(
        select(Schedule).where(Schedule.tenant_id == tenant_id).order_by(Schedule.name)
    ).all()


def set_paused(session: Session, schedule: Schedule, paused: bool) -> Schedule:
    """Pause, or resume from the next tick after now (ticks while paused are not run)."""
    if paused == schedule.paused:
        return schedule
    schedule.paused = paused
    if not paused:
        clock = int(session.scalar(select(now_ms())) or 0)
        schedule.next_fire_ms = next_tick(schedule.cron, schedule.timezone, clock)
    session.flush()
    return schedule


@dataclasses.dataclass(frozen=True)
class Fired:
    schedule_id: str
    tick_ms: int
    task_id: str | None  # None: the tick was skipped (missed, with catch_up "skip")


def due(session: Session, *, limit: int = 100) -> list[str]:
    return list(
        session.scalars(
            select(Schedule.id)
            .where(Schedule.paused.is_(False), Schedule.next_fire_ms <= now_ms())
            .order_by(Schedule.next_fire_ms)
            .limit(limit)
        )
    )


def fire(
    session: Session, schedule_id: str, *, grace_ms: int, deliveries: list[str]
) -> Fired | None:
    """Fire the schedule's due tick, in the caller's transaction (``deliveries`` gets the
    webhooks of its task's ``task.queued``); None if it is not due (or another dispatcher
    fired it first)."""
    schedule = session.scalar(
        select(Schedule).where(Schedule.id == schedule_id).with_for_update(skip_locked=True)
    )
    clock = int(session.scalar(select(now_ms())) or 0)
    if schedule is None or schedule.paused or schedule.next_fire_ms > clock:
        return None
    tick = schedule.next_fire_ms
    following = next_tick(schedule.cron, schedule.timezone, tick)
    missed = clock - tick > grace_ms
    if missed:
        latest = tick
        for _ in range(MAX_CATCH_UP_STEPS):
            if following > clock:
                break
            latest, following = following, next_tick(schedule.cron, schedule.timezone, following)
        tick = latest
    task_id = None
    if not missed or schedule.catch_up == "run_once":
        task_id, created = _submit(session, schedule, tick, deliveries)
        schedule.fired += 1 if created else 0
        schedule.last_fired_ms, schedule.last_task_id = tick, task_id
    else:
        schedule.skipped += 1
    moved = session.execute(
        update(Schedule)
        .where(Schedule.id == schedule.id, Schedule.next_fire_ms == schedule.next_fire_ms)
        .values(
            next_fire_ms=following,
            fired=schedule.fired,
            skipped=schedule.skipped,
            last_fired_ms=schedule.last_fired_ms,
            last_task_id=schedule.last_task_id,
            last_error=None,
        )
        .execution_options(synchronize_session=False)
    )
    if moved.rowcount != 1:  # type: ignore[attr-defined]
        raise Conflict("the schedule moved on meanwhile")
    return Fired(schedule.id, tick, task_id)


def _submit(
    session: Session, schedule: Schedule, tick_ms: int, deliveries: list[str]
) -> tuple[str, bool]:
    """The tick's task (created, or found: the tick fired before), and whether it is new."""
    spec = tasks.NewTask(**{**schedule.body["spec"], "schedule_id": schedule.id})
    key = f"schedule:{schedule.id}:{tick_ms}"
    existing = tasks.find_by_idempotency_key(session, schedule.tenant_id, key)
    if existing is not None:
        return existing.id, False
    task = tasks.create_task(
        session, schedule.tenant_id, spec, idempotency_key=key, deliveries=deliveries
    )
    return task.id, True
