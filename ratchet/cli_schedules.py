"""``ratchet schedules``: a tenant's schedules, straight on the database (the operator's
tools; a tenant manages its own over HTTP too, at ``/v1/schedules``)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ratchet.console import fail, print_json

schedules = typer.Typer(no_args_is_help=True, help="Tasks submitted on a cron expression.")

TenantOption = Annotated[str, typer.Option(help="tenant name")]
NameArgument = Annotated[str, typer.Argument(help="the schedule's name")]


def _show(schedule: object) -> dict[str, object]:
    from api.routes.admin import schedule_out
    from shared.store.tables import Schedule

    assert isinstance(schedule, Schedule)
    return schedule_out(schedule).model_dump(mode="json")


PAGE = 100  # schedules read at a time: a page's task bodies are bounded, a tenant's too


@schedules.command("list")
def schedules_list(tenant: TenantOption) -> None:
    """The tenant's schedules as JSON, by name: cron, zone, next and last tick, ticks fired."""
    from shared.scheduling import schedules as store
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import get_tenant_by_name

    require_migrated()
    shown: list[dict[str, object]] = []
    after: str | None = None
    while True:
        with transaction() as session:
            tenant_id = get_tenant_by_name(session, tenant).id
            page = store.list_for(session, tenant_id, after=after, limit=PAGE)
            shown += [_show(s) for s in page]
        if len(page) < PAGE:
            break
        after = page[-1].name
    print_json(shown)


@schedules.command("add")
def schedules_add(
    tenant: TenantOption,
    name: NameArgument,
    cron: Annotated[
        str,
        typer.Option(
            help="minute hour day month weekday, then optionally a sixth field, the LAST, "
            "for the second: '0 9 * * 1-5' is 9:00 on weekdays, '* * * * * 30' second 30 of "
            "every minute, and '*/5 * * * * *' every second of every fifth minute (not every "
            "5 s). Ticks are at least RATCHET_SCHEDULE_MIN_INTERVAL_SECONDS (60) apart"
        ),
    ],
    task: Annotated[str, typer.Option(help="the task's body as JSON (as POST /v1/tasks)")],
    timezone: Annotated[str, typer.Option(help="an IANA time zone")] = "UTC",
    catch_up: Annotated[
        str, typer.Option(help="missed ticks: run_once (the latest) or skip")
    ] = "run_once",
) -> None:
    """Create a schedule; prints it as JSON."""
    from pydantic import ValidationError

    from api import submission
    from api.schemas import TaskCreate
    from shared.errors import RatchetError
    from shared.scheduling import schedules as store
    from shared.settings import get_settings
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import get_tenant_by_name

    require_migrated()
    if catch_up not in store.CATCH_UP:
        raise fail("--catch-up must be run_once or skip")
    try:
        body = TaskCreate.model_validate(json.loads(task))
        if body.run_at is not None or body.delay_seconds is not None:
            raise fail("a schedule's task runs at its ticks: no run_at or delay_seconds")
        spec = submission.resolve(body, get_settings())
        with transaction() as session:
            created = store.create(
                session,
                get_tenant_by_name(session, tenant).id,
                name=name,
                cron=cron,
                timezone=timezone,
                spec=spec,
                request=body.model_dump(mode="json", exclude_defaults=True),
                catch_up=catch_up,
                created_by="cli",
            )
            print_json(_show(created))
    except json.JSONDecodeError as exc:
        raise fail(f"--task is not JSON: {exc}") from None
    except ValidationError as exc:
        raise fail(f"--task: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None
    except RatchetError as exc:
        raise fail(str(exc)) from None


def _set_paused(tenant: str, name: str, paused: bool) -> None:
    from sqlalchemy import select

    from shared.scheduling import schedules as store
    from shared.store.db import require_migrated, transaction
    from shared.store.tables import Schedule
    from shared.store.tenants import get_tenant_by_name

    require_migrated()
    with transaction() as session:
        tenant_id = get_tenant_by_name(session, tenant).id
        schedule = session.scalar(
            select(Schedule).where(Schedule.tenant_id == tenant_id, Schedule.name == name)
        )
        if schedule is None:
            raise fail(f"tenant {tenant!r} has no schedule {name!r}")
        print_json(_show(store.set_paused(session, schedule, paused)))


@schedules.command("pause")
def schedules_pause(tenant: TenantOption, name: NameArgument) -> None:
    """No tick fires until it is resumed."""
    _set_paused(tenant, name, True)


@schedules.command("resume")
def schedules_resume(tenant: TenantOption, name: NameArgument) -> None:
    """Fire again from the next tick after now."""
    _set_paused(tenant, name, False)


@schedules.command("delete")
def schedules_delete(tenant: TenantOption, name: NameArgument) -> None:
    """Delete the schedule (the tasks it fired stay)."""
    from sqlalchemy import delete

    from shared.store.db import require_migrated, transaction
    from shared.store.tables import Schedule
    from shared.store.tenants import get_tenant_by_name

    require_migrated()
    with transaction() as session:
        tenant_id = get_tenant_by_name(session, tenant).id
        done = session.execute(
            delete(Schedule).where(Schedule.tenant_id == tenant_id, Schedule.name == name)
        )
        if done.rowcount != 1:  # type: ignore[attr-defined]
            raise fail(f"tenant {tenant!r} has no schedule {name!r}")
    typer.echo(f"deleted {name}", err=True)
