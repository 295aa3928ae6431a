"""What a tenant can do with its schedules (create, pause, resume, delete them) and what the
scheduler does with them (fire a tick). Each is one transaction; firing returns the messages
its task's creation calls for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from shared.actions.effects import NONE, Effects
from shared.scheduling import schedules
from shared.store.tables import Schedule
from shared.store.tasks import NewTask


def create(
    session: Session,
    tenant_id: str,
    *,
    name: str,
    cron: str,
    timezone: str,
    spec: NewTask,
    request: dict[str, Any],
    catch_up: str,
    created_by: str,
) -> Schedule:
    """A new schedule submitting ``spec`` (asked for as ``request``) at every tick, within
    the tenant's bounds (see ``schedules.create``)."""
    with session.begin():
        return schedules.create(
            session,
            tenant_id,
            name=name,
            cron=cron,
            timezone=timezone,
            spec=spec,
            request=request,
            catch_up=catch_up,
            created_by=created_by,
        )


def pause(session: Session, tenant_id: str, schedule_id: str, *, paused: bool) -> Schedule:
    """Pause the schedule (no tick fires, missed ones are not run) or resume it from its next
    tick after now."""
    with session.begin():
        schedule = schedules.get(session, tenant_id, schedule_id)
        return schedules.set_paused(session, schedule, paused)


def delete(session: Session, tenant_id: str, schedule_id: str) -> None:
    """Remove the schedule; the tasks it fired are not touched."""
    with session.begin():
        session.delete(schedules.get(session, tenant_id, schedule_id))


@dataclass(frozen=True)
class Fired:
    """What firing a schedule did (None: nothing was due), and what to send for it."""

    fired: schedules.Fired | None
    effects: Effects = NONE


def fire(session: Session, schedule_id: str, *, grace_ms: int) -> Fired:
    """Fire the schedule's due tick, once across the fleet (see ``schedules.fire``); its
    task waits in the backlog, where the dispatcher that fired it admits it."""
    with session.begin():
        fired = schedules.fire(session, schedule_id, grace_ms=grace_ms)
    if fired is None or not fired.deliveries:
        return Fired(fired)
    return Fired(fired, Effects(deliveries=tuple(fired.deliveries)))
