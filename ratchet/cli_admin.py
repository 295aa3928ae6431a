"""``ratchet tenants|keys``: tenants and their API keys, straight on the database (the
operator's tools; an API key cannot do this). ``ratchet webhooks`` is ``cli_webhooks``."""

from __future__ import annotations

import json
import re
import shlex
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ratchet.console import err, fail

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from shared.store.tables import ApiKey, Tenant

tenants = typer.Typer(no_args_is_help=True, help="Manage tenants.")
keys = typer.Typer(no_args_is_help=True, help="Manage API keys.")


def tenant_named(session: Session, name: str) -> Tenant:
    """The tenant of that name, or a one-line error that says how to create it."""
    from shared.errors import NotFound
    from shared.store.tenants import get_tenant_by_name

    try:
        return get_tenant_by_name(session, name)
    except NotFound:
        create = f"ratchet tenants create {shlex.quote(name)}"
        raise fail(f"no tenant named {name!r}: create it with `{create}`", 1) from None


@tenants.command("create")
def tenants_create(
    name: str,
    scope: Annotated[list[str] | None, typer.Option(help="scopes of the first key")] = None,
) -> None:
    """Create a tenant and print its first API key (alone on stdout)."""
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import DEFAULT_SCOPES, create_key, create_tenant

    require_migrated()
    with transaction() as session:
        tenant = create_tenant(session, name)
        key = create_key(session, tenant, tuple(scope or DEFAULT_SCOPES))
    err(f"created tenant {name!r}")
    typer.echo(key)


@tenants.command("list")
def tenants_list() -> None:
    """Print every tenant as JSON: id, name, created_at."""
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import list_tenants

    require_migrated()
    with transaction() as session:
        rows = [
            {"id": t.id, "name": t.name, "created_at": _iso(t.created_at)}
            for t in list_tenants(session)
        ]
    typer.echo(json.dumps(rows, indent=2))


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()


def _duration(text: str) -> timedelta:
    """``90``, ``90s``, ``15m``, ``12h`` or ``30d``."""
    match = re.fullmatch(r"(\d+)([smhd]?)", text.strip())
    if match is None:
        raise fail(f"{text!r} is not a duration like 3600, 90s, 15m, 12h or 30d")
    unit = {"": "seconds", "s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
    return timedelta(**{unit[match[2]]: int(match[1])})


def _expiry(expires_in: str | None, expires_at: str | None) -> datetime | None:
    if expires_in and expires_at:
        raise fail("give --expires-in or --expires-at, not both")
    if expires_in:
        return datetime.now(UTC) + _duration(expires_in)
    if not expires_at:
        return None
    try:
        moment = datetime.fromisoformat(expires_at)
    except ValueError:
        raise fail(f"--expires-at {expires_at!r} is not an ISO 8601 time") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _key_json(row: ApiKey) -> dict[str, Any]:
    return {
        "id": row.id,
        "prefix": row.prefix,
        "name": row.name,
        "scopes": row.scopes,
        "created_at": _iso(row.created_at),
        "expires_at": _iso(row.expires_at),
        "last_used_at": _iso(row.last_used_at),
        "revoked_at": _iso(row.revoked_at),
    }


@keys.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="tenant name")],
    scope: Annotated[
        list[str] | None,
        typer.Option(help="tasks:read, tasks:write, tasks:approve, admin, operator"),
    ] = None,
    name: Annotated[str | None, typer.Option(help="what the key is for")] = None,
    expires_in: Annotated[
        str | None, typer.Option(help="lifetime: 3600, 90s, 15m, 12h or 30d")
    ] = None,
    expires_at: Annotated[
        str | None, typer.Option(help="expiry as an ISO 8601 time (UTC if no offset)")
    ] = None,
) -> None:
    """Create an API key for a tenant and print it (alone on stdout). It is shown only once.

    Only here can a key get the operator scope (fleet-wide views and actions)."""
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import DEFAULT_SCOPES, create_key

    expiry = _expiry(expires_in, expires_at)
    require_migrated()
    with transaction() as session:
        key = create_key(
            session,
            tenant_named(session, tenant),
            tuple(scope or DEFAULT_SCOPES),
            name=name,
            expires_at=expiry,
        )
    typer.echo(key)


@keys.command("list")
def keys_list(tenant: Annotated[str, typer.Option(help="tenant name")]) -> None:
    """Print the tenant's keys as JSON, newest first: prefix, name, scopes, last use."""
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import list_keys

    require_migrated()
    with transaction() as session:
        tenant_id = tenant_named(session, tenant).id
        rows = [_key_json(row) for row in list_keys(session, tenant_id, limit=10_000)]
    typer.echo(json.dumps(rows, indent=2))


@keys.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="the key's id (see `keys list`)")],
    tenant: Annotated[str, typer.Option(help="tenant name")],
) -> None:
    """Revoke a key: the next request that carries it is refused."""
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import revoke_key

    require_migrated()
    with transaction() as session:
        row = revoke_key(session, tenant_named(session, tenant).id, key_id)
        prefix = row.prefix
    err(f"revoked key {prefix}…")


@keys.command("rotate")
def keys_rotate(
    key_id: Annotated[str, typer.Argument(help="the key's id (see `keys list`)")],
    tenant: Annotated[str, typer.Option(help="tenant name")],
    grace: Annotated[
        str, typer.Option(help="how long the old key keeps working: 0, 90s, 15m, 12h, 7d")
    ] = "0",
) -> None:
    """Print a new key (alone on stdout) with the old one's name, scopes and lifetime; the old
    key stops working after the grace period (default: at once)."""
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import rotate_key

    period = _duration(grace)
    require_migrated()
    with transaction() as session:
        _, key = rotate_key(session, tenant_named(session, tenant).id, key_id, grace=period)
    err(f"rotated; the old key stops working {'now' if not period else f'in {period}'}")
    typer.echo(key)
