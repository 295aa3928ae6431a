"""``ratchet webhooks``: a tenant's webhook signing secret and default endpoints, straight on
the database (the operator's tools; a tenant admin manages its endpoints over HTTP too, at
``/v1/webhook-endpoints``)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ratchet.cli_admin import tenant_named
from ratchet.console import err, fail, print_json

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from shared.store.tables import WebhookEndpoint

webhooks = typer.Typer(no_args_is_help=True, help="Webhook secrets and endpoints.")

TenantOption = Annotated[str, typer.Option(help="tenant name")]
EndpointArgument = Annotated[str, typer.Argument(help="the endpoint's id (see `webhooks list`)")]


@webhooks.command("secret")
def webhooks_secret(
    tenant: TenantOption,
    rotate: Annotated[
        bool, typer.Option(help="make a new secret; the old one keeps signing for the overlap")
    ] = False,
) -> None:
    """Print the tenant's current webhook signing secret (alone on stdout)."""
    from shared.settings import get_settings
    from shared.store.db import require_migrated, transaction
    from shared.webhooks import secrets as webhook_secrets

    require_migrated()
    overlap = timedelta(hours=get_settings().webhook_secret_overlap_hours)
    with transaction() as session:
        tenant_id = tenant_named(session, tenant).id
        if rotate:
            secret = webhook_secrets.rotate(session, tenant_id, overlap=overlap)
        else:
            secret = webhook_secrets.current(session, tenant_id)
    if rotate:
        err(f"rotated; the previous secret keeps signing for {overlap}")
    typer.echo(secret)


def _invalid(exc: Exception) -> typer.Exit:
    """The CLI's answer to a URL or event types the store refused."""
    from shared.errors import InvalidRequest
    from shared.settings import get_settings

    if not (isinstance(exc, InvalidRequest) and exc.field == "url"):
        return fail(str(exc))
    allowed = get_settings().webhook_allowed_hosts
    # The workers check again when they send; this check can only see this shell's setting.
    return fail(
        f"{exc.reason}. This command checks the URL against RATCHET_WEBHOOK_ALLOWED_HOSTS in "
        f"its own environment (here: {','.join(allowed) or 'not set'}): set it here too, to "
        "the value the workers have",
        1,
    )


def _endpoint_json(row: WebhookEndpoint, session: Session) -> dict[str, Any]:
    """The endpoint as every front door describes it (``GET /v1/webhook-endpoints/{id}``
    too: ``shared.actions.webhooks``), with its tenant's id."""
    from dataclasses import asdict

    from shared.actions.webhooks import describe

    [endpoint] = describe(session, [row])
    described = asdict(endpoint)
    described["created_at"] = _iso(endpoint.created_at)
    described["circuit"]["until"] = _iso(endpoint.circuit.until)
    return described


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


EventOption = Annotated[
    list[str] | None, typer.Option("--event", help="an event type; repeat for more")
]


def _add(tenant: str, url: str, event: list[str] | None) -> None:
    from shared.errors import Conflict, InvalidRequest
    from shared.store.db import require_migrated, transaction
    from shared.webhooks import endpoints

    require_migrated()
    try:
        with transaction() as session:
            tenant_id = tenant_named(session, tenant).id
            events = event or endpoints.DEFAULT_EVENTS
            endpoint = endpoints.create(session, tenant_id, url=url, events=events)
    except InvalidRequest as exc:
        raise _invalid(exc) from None
    except Conflict as exc:  # the tenant has its most endpoints
        raise fail(str(exc), 1) from None
    typer.echo(endpoint.id)


@webhooks.command("add")
def webhooks_add(
    tenant: TenantOption,
    url: Annotated[str, typer.Option(help="the receiver's URL (https)")],
    event: EventOption = None,
) -> None:
    """Add a default endpoint and print its id (alone on stdout).

    It receives these events (default: the terminal ones) of every task of the tenant."""
    _add(tenant, url, event)


@webhooks.command("add-endpoint", hidden=True)
def webhooks_add_endpoint(
    tenant: TenantOption,
    url: Annotated[str, typer.Option(help="the receiver's URL (https)")],
    event: EventOption = None,
) -> None:
    """The former name of ``webhooks add``."""
    _add(tenant, url, event)


@webhooks.command("list")
def webhooks_list(
    tenant: Annotated[
        str | None, typer.Option(help="tenant name (default: every tenant's endpoints)")
    ] = None,
) -> None:
    """Print the endpoints as JSON, newest first, with their last 24 hours' deliveries."""
    from shared.store.db import require_migrated, transaction
    from shared.webhooks import endpoints

    require_migrated()
    with transaction() as session:
        tenant_id = tenant_named(session, tenant).id if tenant else None
        rows = endpoints.list_for(session, tenant_id, limit=10_000)
        listed = [_endpoint_json(row, session) for row in rows]
    print_json(listed)


@webhooks.command("update")
def webhooks_update(
    endpoint_id: EndpointArgument,
    tenant: TenantOption,
    url: Annotated[str | None, typer.Option(help="the receiver's new URL (https)")] = None,
    event: Annotated[
        list[str] | None, typer.Option("--event", help="the new event types; repeat for more")
    ] = None,
) -> None:
    """Change an endpoint's URL or event types; prints it as JSON."""
    from shared.errors import InvalidRequest
    from shared.store.db import require_migrated, transaction
    from shared.webhooks import endpoints

    if url is None and not event:
        raise fail("give --url or --event")
    require_migrated()
    try:
        with transaction() as session:
            tenant_id = tenant_named(session, tenant).id
            row = endpoints.update(session, tenant_id, endpoint_id, url=url, events=event)
            updated = _endpoint_json(row, session)
    except InvalidRequest as exc:
        raise _invalid(exc) from None
    print_json(updated)


def _set_enabled(endpoint_id: str, tenant: str, enabled: bool, reason: str | None) -> None:
    from shared.store.db import require_migrated, transaction
    from shared.webhooks import endpoints

    require_migrated()
    with transaction() as session:
        tenant_id = tenant_named(session, tenant).id
        row = endpoints.set_enabled(session, tenant_id, endpoint_id, enabled, reason)
        changed = _endpoint_json(row, session)
    print_json(changed)


@webhooks.command("enable")
def webhooks_enable(endpoint_id: EndpointArgument, tenant: TenantOption) -> None:
    """Send to the endpoint again (say, after a 410 disabled it); prints it as JSON.

    Events written while it was disabled are not sent to it."""
    _set_enabled(endpoint_id, tenant, True, None)


@webhooks.command("disable")
def webhooks_disable(
    endpoint_id: EndpointArgument,
    tenant: TenantOption,
    reason: Annotated[
        str, typer.Option(help="why, shown as its disabled_reason")
    ] = "disabled with the ratchet CLI",
) -> None:
    """Stop sending to the endpoint, deliveries already queued included; prints it as JSON."""
    _set_enabled(endpoint_id, tenant, False, reason)


@webhooks.command("delete")
def webhooks_delete(endpoint_id: EndpointArgument, tenant: TenantOption) -> None:
    """Remove the endpoint; its deliveries still queued are not sent."""
    from shared.store.db import require_migrated, transaction
    from shared.webhooks import endpoints

    require_migrated()
    with transaction() as session:
        endpoints.delete(session, tenant_named(session, tenant).id, endpoint_id)
    err(f"deleted webhook endpoint {endpoint_id}")
