"""``ratchet secrets``: the operator's side of tenant secrets: a key for
``RATCHET_SECRETS_KEY``, re-encrypting every stored value under its first key, and a tenant's
audit log (a tenant admin sets, lists and deletes secrets over HTTP, at ``/v1/secrets``)."""

from __future__ import annotations

from typing import Annotated

import typer

from ratchet.cli_admin import tenant_named
from ratchet.console import err, fail, print_json

secrets = typer.Typer(no_args_is_help=True, help="Tenant secrets: keys and re-encryption.")


@secrets.command("new-key")
def secrets_new_key() -> None:
    """Print a new key for RATCHET_SECRETS_KEY (alone on stdout). To rotate, put it first:
    RATCHET_SECRETS_KEY=<new>,<old>; run `ratchet secrets reencrypt`; then drop <old>."""
    from shared.vault import new_key

    typer.echo(new_key())


@secrets.command("reencrypt")
def secrets_reencrypt() -> None:
    """Re-encrypt every tenant's secrets (and its MCP servers' headers) under the first key
    of RATCHET_SECRETS_KEY (values already under it are left alone: running it again changes
    nothing). Afterwards the other keys may be removed."""
    from shared.actions.secrets import reencrypt_all
    from shared.errors import Conflict
    from shared.store.db import get_sessionmaker, require_migrated

    require_migrated()
    try:
        with get_sessionmaker()() as session:
            seen, rewritten = reencrypt_all(session)
    except Conflict as exc:  # no key configured, or a value no configured key opens
        raise fail(str(exc), 1) from None
    err(f"{seen} value(s): {rewritten} re-encrypted under the first key, the rest already were")


@secrets.command("audit")
def secrets_audit(
    tenant: Annotated[str, typer.Option(help="tenant name")],
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="at most this many")] = 100,
) -> None:
    """Print the tenant's audit log as JSON, newest first: who set or deleted which secret
    (or added or removed which MCP server), and when. Never a value."""
    from shared.store import audit
    from shared.store.db import require_migrated, transaction

    require_migrated()
    with transaction() as session:
        rows = audit.list_for(session, tenant_named(session, tenant).id, limit=limit)
        entries = [
            {
                "at": row.at.isoformat(),
                "actor": row.actor,
                "action": row.action,
                "target": row.target,
            }
            for row in rows
        ]
    print_json(entries)
