"""``ratchet schedules``: the schedules of RATCHET_KEY's tenant, over HTTP (RATCHET_URL), as
``/v1/schedules`` has them. The server checks each schedule's task with its own settings (the
models it can call, its agents), as it checks a submission: the command reads no settings."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ratchet.console import api_client, err, fail, print_json

if TYPE_CHECKING:
    from ratchet.client import Client

schedules = typer.Typer(
    no_args_is_help=True,
    help="Tasks submitted on a cron expression (the tenant of RATCHET_KEY, over RATCHET_URL).",
)

NameArgument = Annotated[str, typer.Argument(help="the schedule's name")]
TenantOption = Annotated[
    str | None,
    typer.Option(hidden=True, help="no longer taken: the tenant is RATCHET_KEY's"),
]
CRON_HELP = (
    "minute hour day month weekday, then optionally a sixth field, the LAST, for the second: "
    "'0 9 * * 1-5' is 9:00 on weekdays, '* * * * * 30' second 30 of every minute, and "
    "'*/5 * * * * *' every second of every fifth minute (not every 5 s). Ticks are at least "
    "RATCHET_SCHEDULE_MIN_INTERVAL_SECONDS (60) apart"
)


def refuse_tenant(tenant: str | None) -> None:
    """The commands once took ``--tenant`` and went to the database; a key says the tenant now.
    Named anyway, it is refused rather than ignored: the key's tenant may be another one."""
    if tenant is not None:
        raise fail(
            "schedules act on the tenant of RATCHET_KEY, over RATCHET_URL: drop --tenant. For "
            f"tenant {tenant!r}, use a key of its own: ratchet keys create --tenant {tenant} "
            "--scope tasks:read --scope tasks:write"
        )


@schedules.command("list")
def schedules_list(tenant: TenantOption = None) -> None:
    """The tenant's schedules as JSON, by name: cron, zone, next and last tick, ticks fired."""
    refuse_tenant(tenant)
    with api_client() as client:
        print_json(client.schedules())


@schedules.command("add")
def schedules_add(
    name: NameArgument,
    cron: Annotated[str, typer.Option(help=CRON_HELP)],
    task: Annotated[str, typer.Option(help="the task's body as JSON (as POST /v1/tasks)")],
    timezone: Annotated[str, typer.Option(help="an IANA time zone")] = "UTC",
    catch_up: Annotated[
        str, typer.Option(help="missed ticks: run_once (the latest) or skip")
    ] = "run_once",
    tenant: TenantOption = None,
) -> None:
    """Create a schedule; prints it as JSON. The server checks its task as a submission."""
    refuse_tenant(tenant)
    try:
        body = json.loads(task)
    except ValueError as exc:
        raise fail(f"--task is not JSON: {exc}") from None
    schedule = {"name": name, "cron": cron, "timezone": timezone, "catch_up": catch_up}
    with api_client() as client:
        print_json(client.create_schedule({**schedule, "task": body}))


def find(client: Client, name: str) -> dict[str, Any]:
    """The tenant's schedule of that name, or a one-line error."""
    for schedule in client.schedules():
        if schedule["name"] == name:
            return schedule
    raise fail(f"no schedule named {name!r} (the tenant of RATCHET_KEY has none)", 1)


@schedules.command("pause")
def schedules_pause(name: NameArgument, tenant: TenantOption = None) -> None:
    """No tick fires until it is resumed."""
    refuse_tenant(tenant)
    with api_client() as client:
        print_json(client.pause_schedule(find(client, name)["id"]))


@schedules.command("resume")
def schedules_resume(name: NameArgument, tenant: TenantOption = None) -> None:
    """Fire again from the next tick after now."""
    refuse_tenant(tenant)
    with api_client() as client:
        print_json(client.resume_schedule(find(client, name)["id"]))


@schedules.command("delete")
def schedules_delete(name: NameArgument, tenant: TenantOption = None) -> None:
    """Delete the schedule (the tasks it fired stay)."""
    refuse_tenant(tenant)
    with api_client() as client:
        client.delete_schedule(find(client, name)["id"])
    err(f"deleted {name}")
