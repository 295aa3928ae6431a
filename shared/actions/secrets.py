"""What a tenant admin can do to its tenant's secrets: set, delete and list them, each one
transaction that records who did it (``shared.store.audit``); and what the operator can do
to every tenant's: re-encrypt them under the first key of ``RATCHET_SECRETS_KEY``.

A value goes in and never comes out: a list names the secrets with their dates, and only a
tool that declares one reads it (``workers/steps/tools.py``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from sqlalchemy.orm import Session

from shared.errors import InvalidRequest
from shared.store import audit, mcp_servers
from shared.store import tenant_secrets as secret_store
from shared.store.tables import Secret
from shared.vault import get_vault

NAME_PATTERN = r"^[A-Z][A-Z0-9_]{0,63}$"
MAX_VALUE_BYTES = 64 * 1024
_NAME = re.compile(NAME_PATTERN)


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise InvalidRequest(
            "name", "1 to 64 of A-Z, 0-9 and _, starting with a letter (e.g. GITHUB_TOKEN)"
        )
    return name


def check_value(value: str) -> str:
    if not value:
        raise InvalidRequest("value", "a secret's value is not empty")
    if len(value.encode("utf-8")) > MAX_VALUE_BYTES:
        raise InvalidRequest("value", f"at most {MAX_VALUE_BYTES} bytes (UTF-8)")
    return value


def set_secret(
    session: Session, tenant_id: str, name: str, value: str, *, actor: str
) -> tuple[Secret, bool]:
    """Set the tenant's secret (replacing its value if it exists); ``(row, created)``.
    SecretsNotConfigured without a key; InvalidRequest for a bad name or value."""
    check_name(name)
    check_value(value)
    vault = get_vault()
    with session.begin():
        created = secret_store.put(session, tenant_id, name, value, vault=vault)
        audit.record(session, tenant_id, actor=actor, action="secret.set", target=name)
        row = secret_store.get(session, tenant_id, name)
        session.expunge(row)
    return row, created


def delete_secret(session: Session, tenant_id: str, name: str, *, actor: str) -> None:
    """Delete the tenant's secret (NotFound if it has none, another tenant's included)."""
    check_name(name)
    with session.begin():
        secret_store.remove(session, tenant_id, name)
        audit.record(session, tenant_id, actor=actor, action="secret.delete", target=name)


def list_secrets(
    session: Session, tenant_id: str, *, after: str | None, limit: int
) -> Sequence[Secret]:
    """A page of the tenant's secrets by name (their names and dates; never a value)."""
    with session.begin():
        rows = secret_store.list_for(session, tenant_id, after=after, limit=limit)
        session.expunge_all()
    return rows


def reencrypt_all(session: Session, *, page: int = 500) -> tuple[int, int]:
    """Re-encrypt every tenant's secrets, and its MCP servers' headers, under the first key,
    a page per transaction; ``(seen, rewritten)``. Idempotent: what is already under the
    first key is left alone. SecretUnreadable (and that page not written) if a value opens
    with no configured key."""
    vault = get_vault()
    seen = rewritten = 0
    for reencrypt_page in (secret_store.reencrypt_page, mcp_servers.reencrypt_page):
        after: str | None = None
        while True:
            with session.begin():
                count, changed, after = reencrypt_page(
                    session, vault=vault, after=after, limit=page
                )
            seen, rewritten = seen + count, rewritten + changed
            if count < page:
                break
    return seen, rewritten
