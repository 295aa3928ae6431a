"""Tenant secrets as stored: one row per (tenant, name), the value a Fernet token. (Not the
webhook signing secrets: those are ``shared/webhooks/secrets.py``.)

Every function takes a vault or none: listing and deleting need no key, reading and writing
a value do. Nothing here returns a value except :func:`values_for`, which the worker calls
for the names a tool declared.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from shared.errors import NotFound
from shared.ids import new_id
from shared.store.tables import Secret, utcnow
from shared.vault import Vault


def put(session: Session, tenant_id: str, name: str, value: str, *, vault: Vault) -> bool:
    """Set the tenant's secret ``name`` to ``value`` (encrypted); True if it is new."""
    row = session.scalar(
        select(Secret).where(Secret.tenant_id == tenant_id, Secret.name == name).with_for_update()
    )
    ciphertext = vault.encrypt(value)
    if row is not None:
        row.ciphertext, row.updated_at = ciphertext, utcnow()
        session.flush()
        return False
    now = utcnow()
    session.add(
        Secret(
            id=new_id(),
            tenant_id=tenant_id,
            name=name,
            ciphertext=ciphertext,
            created_at=now,
            updated_at=now,
        )
    )
    session.flush()
    return True


def get(session: Session, tenant_id: str, name: str) -> Secret:
    """The tenant's secret row ``name`` (NotFound otherwise, another tenant's too)."""
    row = session.scalar(select(Secret).where(Secret.tenant_id == tenant_id, Secret.name == name))
    if row is None:
        raise NotFound(f"no secret named {name!r}")
    return row


def remove(session: Session, tenant_id: str, name: str) -> None:
    """Delete the tenant's secret ``name`` (NotFound if it has none)."""
    deleted = session.execute(
        delete(Secret)
        .where(Secret.tenant_id == tenant_id, Secret.name == name)
        .execution_options(synchronize_session=False)
    )
    if not getattr(deleted, "rowcount", 0):
        raise NotFound(f"no secret named {name!r}")


def list_for(
    session: Session, tenant_id: str, *, after: str | None = None, limit: int = 50
) -> Sequence[Secret]:
    """The tenant's secrets by name, after ``after`` (a name): a keyset page."""
    query = select(Secret).where(Secret.tenant_id == tenant_id)
    if after is not None:
        query = query.where(Secret.name > after)
    return session.scalars(query.order_by(Secret.name).limit(limit)).all()


def values_for(
    session: Session, tenant_id: str, names: Iterable[str], *, vault: Vault
) -> dict[str, str]:
    """The values of those of ``names`` the tenant has set, decrypted; the others are absent."""
    wanted = list(dict.fromkeys(names))
    if not wanted:
        return {}
    rows = session.execute(
        select(Secret.name, Secret.ciphertext).where(
            Secret.tenant_id == tenant_id, Secret.name.in_(wanted)
        )
    ).all()
    return {name: vault.decrypt(token, name=name) for name, token in rows}


def reencrypt_page(
    session: Session, *, vault: Vault, after: str | None, limit: int
) -> tuple[int, int, str | None]:
    """Re-encrypt under the vault's first key one page of every tenant's secrets (by id,
    after ``after``): ``(seen, rewritten, last id)``. A row already under the first key is
    left as it is, so running it again rewrites nothing."""
    query = select(Secret).order_by(Secret.id).limit(limit).with_for_update()
    if after is not None:
        query = query.where(Secret.id > after)
    rows = session.scalars(query).all()
    rewritten = 0
    for row in rows:
        if (moved := vault.moved(row.ciphertext)) is not None:
            row.ciphertext = moved
            rewritten += 1
    session.flush()
    return len(rows), rewritten, rows[-1].id if rows else None
