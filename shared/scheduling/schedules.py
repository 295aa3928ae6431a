"""Schedules: a task body submitted on a cron expression in a time zone.

The dispatcher fires them (one dispatcher leads the fleet at a time). Each tick is fired in
one transaction that locks the schedule's row, creates the tick's task with the idempotency
key ``schedule:<id>:<tick>`` and moves ``next_fire_ms`` on, conditional on the tick it read:
so a tick fires once, whichever dispatcher, crash or failover. A tick later than
``RATCHET_SCHEDULE_MISFIRE_GRACE_SECONDS`` (the fleet was down) is missed; the schedule's
``catch_up`` policy then runs the latest missed tick once (``run_once``) or skips them all
(``skip``), and the schedule goes on from the next tick after now.

Schedules are bounded, so that no tenant's schedules weigh on the others: a tenant has at most
``RATCHET_MAX_SCHEDULES_PER_TENANT`` of them, each carrying at most
``RATCHET_SCHEDULE_MAX_TASK_BYTES`` of task body, and no cron may fire more often than every
``RATCHET_SCHEDULE_MIN_INTERVAL_SECONDS``. They are checked when a schedule is created; a
list of them is read a page at a time, by name.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadCronError, CroniterBadDateError, croniter
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.agents import versions
from shared.errors import Conflict, InvalidRequest, NotFound
from shared.ids import new_id
from shared.settings import get_settings
from shared.store import tasks
from shared.store.backends import hold_tenant_lock
from shared.store.db import now_ms
from shared.store.tables import Schedule

log = logging.getLogger("ratchet.schedules")
CATCH_UP = ("run_once", "skip")
MAX_CATCH_UP_STEPS = 100_000  # ticks looked through to find the latest one missed
SCHEDULE_LOCK_NAMESPACE = 0x5253  # "RS": the advisory locks of tenants' schedules
FIELDS = (
    "minute hour day month weekday, then optionally a sixth field, the last, for the second "
    "(`*/5 * * * *` fires every 5 minutes; `*/5 * * * * *` every second of every fifth "
    "minute; `* * * * * 30` at second 30 of every minute)"
)


def check_cron(expression: str, timezone: str) -> ZoneInfo:
    """The time zone, once the expression and the zone are known good and the expression
    never fires twice within ``RATCHET_SCHEDULE_MIN_INTERVAL_SECONDS`` (InvalidRequest)."""
    try:
        zone = ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidRequest("timezone", f"unknown time zone {timezone!r}") from None
    if not croniter.is_valid(expression) or len(expression.split()) not in (5, 6):
        raise InvalidRequest("cron", f"must be a cron expression: {FIELDS}")
    least = get_settings().schedule_min_interval_seconds
    shortest = shortest_interval(expression)
    if shortest < least:
        raise InvalidRequest(
            "cron",
            f"fires {shortest} s apart at its most frequent; the minimum between two ticks "
            f"is {least} s. Fields: {FIELDS}",
        )
    return zone


def shortest_interval(expression: str) -> int:
    """The fewest seconds between two ticks of ``expression`` (a sixth field, if given, is
    the second). Read from its second, minute and hour fields: the days a schedule runs on
    only space its ticks further apart, except across midnight, counted as if the next day
    ran too (so this never says longer than it is; daylight-saving shifts aside)."""
    fields = croniter(expression, second_at_beginning=False).expanded
    seconds = _values(fields[5], 60) if len(fields) > 5 else [0]
    minutes, hours = _values(fields[0], 60), _values(fields[1], 24)
    # From the last tick of one minute (hour, day) to the first of the next one that runs.
    minute_step = min(_gaps(minutes), 60 * _step(hours, 24) + minutes[0] - minutes[-1])
    return min(_gaps(seconds), 60 * minute_step + seconds[0] - seconds[-1])


def _values(field: list[Any], size: int) -> list[int]:
    return list(range(size)) if field == ["*"] else sorted(int(v) for v in field)


def _gaps(values: list[int]) -> int:
    """The least gap between two values within one period (huge if there is one value)."""
    return min((b - a for a, b in itertools.pairwise(values)), default=10**9)


def _step(values: list[int], size: int) -> int:
    """The least gap between two values, the last to the first of the next period included."""
    return min(_gaps(values), values[0] + size - values[-1])


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
    """A new schedule of the tenant's, within the bounds (InvalidRequest for its cron or the
    size of its task, Conflict past the tenant's most schedules or for a name it has). The
    count and the insert are serialized per tenant, so concurrent ones never pass the cap."""
    check_cron(cron, timezone)
    _check_size(request)
    _check_count(session, tenant_id)
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


def _check_size(request: dict[str, Any]) -> None:
    most = get_settings().schedule_max_task_bytes
    size = len(json.dumps(request, separators=(",", ":")).encode())
    if size > most:
        raise InvalidRequest(
            "task", f"is {size} bytes as JSON; a schedule's task may be at most {most} bytes"
        )


def _check_count(session: Session, tenant_id: str) -> None:
    most = get_settings().max_schedules_per_tenant
    hold_tenant_lock(session, tenant_id, namespace=SCHEDULE_LOCK_NAMESPACE)
    count = session.scalar(
        select(func.count()).select_from(Schedule).where(Schedule.tenant_id == tenant_id)
    )
    if (count or 0) >= most:
        raise Conflict(
            f"this tenant has {count} schedules, the most it may have ({most}); "
            f"delete one to create another"
        )


def get(session: Session, tenant_id: str, schedule_id: str) -> Schedule:
    schedule = session.scalar(
        select(Schedule).where(Schedule.id == schedule_id, Schedule.tenant_id == tenant_id)
    )
    if schedule is None:
        raise NotFound(f"no schedule {schedule_id}")
    return schedule


def list_for(
    session: Session, tenant_id: str, *, after: str | None = None, limit: int = 100
) -> Sequence[Schedule]:
    """A page of the tenant's schedules by name: the first ``limit`` named after ``after``
    (through the tenant's unique index on its names)."""
    query = select(Schedule).where(Schedule.tenant_id == tenant_id)
    if after is not None:
        query = query.where(Schedule.name > after)
    return session.scalars(query.order_by(Schedule.name).limit(limit)).all()


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
    deliveries: list[str] = dataclasses.field(default_factory=list)  # its task.queued's


def due(session: Session, *, limit: int = 100) -> list[str]:
    return list(
        session.scalars(
            select(Schedule.id)
            .where(Schedule.paused.is_(False), Schedule.next_fire_ms <= now_ms())
            .order_by(Schedule.next_fire_ms)
            .limit(limit)
        )
    )


def fire(session: Session, schedule_id: str, *, grace_ms: int) -> Fired | None:
    """Fire the schedule's due tick, in the caller's transaction (the webhooks of its task's
    ``task.queued`` to be sent once it commits); None if it is not due (or another
    dispatcher fired it first)."""
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
    task_id: str | None = None
    deliveries: list[str] = []
    if not missed or schedule.catch_up == "run_once":
        task_id, created, deliveries = _submit(session, schedule, tick)
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
    return Fired(schedule.id, tick, task_id, deliveries)


def _submit(session: Session, schedule: Schedule, tick_ms: int) -> tuple[str, bool, list[str]]:
    """The tick's task (created, or found: the tick fired before), whether it is new, and the
    webhook deliveries its creation queued."""
    spec = tasks.NewTask(**{**schedule.body["spec"], "schedule_id": schedule.id})
    key = f"schedule:{schedule.id}:{tick_ms}"
    existing = tasks.find_by_idempotency_key(session, schedule.tenant_id, key)
    if existing is not None:
        return existing.id, False, []
    # Each tick runs the agent as it is defined when the tick fires, not when it was scheduled.
    spec = dataclasses.replace(spec, agent_version=versions.current_version(session, spec.agent))
    created = tasks.create_task(session, schedule.tenant_id, spec, idempotency_key=key)
    return created.task.id, True, created.deliveries
