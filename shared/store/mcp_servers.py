"""Tenant MCP servers as stored (``TenantMcpServer``): one row per (tenant, name). Their
headers are a Fernet token the caller made (``shared.actions.mcp_servers``); nothing here
decrypts them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.errors import Conflict, NotFound
from shared.ids import new_id
from shared.store.tables import TenantMcpServer
from shared.vault import Vault


def add(
    session: Session,
    tenant_id: str,
    *,
    name: str,
    url: str,
    headers_ciphertext: str | None,
    header_names: list[str],
    timeout_seconds: float,
) -> TenantMcpServer:
    """A new server of the tenant's (Conflict if it has one of that name)."""
    row = TenantMcpServer(
        id=new_id(),
        tenant_id=tenant_id,
        name=name,
        url=url,
        headers_ciphertext=headers_ciphertext,
        header_names=header_names,
        timeout_seconds=timeout_seconds,
    )
    try:
        with session.begin_nested():
            session.add(row)
            session.flush()
    except IntegrityError:
        raise Conflict(f"the tenant already has an MCP server named {name!r}") from None
    return row


def count(session: Session, tenant_id: str) -> int:
    found = session.scalar(
        select(func.count())
        .select_from(TenantMcpServer)
        .where(TenantMcpServer.tenant_id == tenant_id)
    )
    return int(found or 0)


def get(session: Session, tenant_id: str, server_id: str) -> TenantMcpServer:
    """The tenant's server ``server_id`` (NotFound otherwise, another tenant's too)."""
    row = session.scalar(
        select(TenantMcpServer).where(
            TenantMcpServer.tenant_id == tenant_id, TenantMcpServer.id == server_id
        )
    )
    if row is None:
        raise NotFound(f"no MCP server {server_id!r}")
    return row


def remove(session: Session, tenant_id: str, server_id: str) -> TenantMcpServer:
    """Delete the tenant's server ``server_id`` and return it (NotFound otherwise)."""
    row = get(session, tenant_id, server_id)
    session.execute(
        delete(TenantMcpServer)
        .where(TenantMcpServer.id == row.id)
        .execution_options(synchronize_session=False)
    )
    return row


def list_for(
    session: Session, tenant_id: str, *, after: str | None = None, limit: int = 50
) -> Sequence[TenantMcpServer]:
    """The tenant's servers by id (oldest first), after ``after``: a keyset page."""
    query = select(TenantMcpServer).where(TenantMcpServer.tenant_id == tenant_id)
    if after is not None:
        query = query.where(TenantMcpServer.id > after)
    return session.scalars(query.order_by(TenantMcpServer.id).limit(limit)).all()


def named(session: Session, tenant_id: str, names: Iterable[str]) -> Sequence[TenantMcpServer]:
    """The tenant's servers among ``names``."""
    wanted = list(names)
    if not wanted:
        return []
    return session.scalars(
        select(TenantMcpServer).where(
            TenantMcpServer.tenant_id == tenant_id, TenantMcpServer.name.in_(wanted)
        )
    ).all()


def reencrypt_page(
    session: Session, *, vault: Vault, after: str | None, limit: int
) -> tuple[int, int, str | None]:
    """Re-encrypt under the vault's first key the headers of one page of every tenant's
    servers (by id, after ``after``): ``(seen, rewritten, last id)``; as
    ``tenant_secrets.reencrypt_page``, headers already under it are left alone."""
    query = select(TenantMcpServer).order_by(TenantMcpServer.id).limit(limit).with_for_update()
    if after is not None:
        query = query.where(TenantMcpServer.id > after)
    rows = session.scalars(query).all()
    rewritten = 0
    for row in rows:
        if row.headers_ciphertext is None:
            continue
        if (moved := vault.moved(row.headers_ciphertext)) is not None:
            row.headers_ciphertext = moved
            rewritten += 1
    session.flush()
    return len(rows), rewritten, rows[-1].id if rows else None
