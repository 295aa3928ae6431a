"""Tenants and their API keys. Keys are stored hashed and shown once, at creation."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared import webhook_secrets
from shared.errors import Conflict, InvalidRequest, NotFound
from shared.ids import hash_secret, new_api_key, new_id
from shared.models import ApiKey, Tenant

SCOPES = ("tasks:read", "tasks:write", "admin")
DEFAULT_SCOPES = ("tasks:read", "tasks:write")


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant and the scopes its key carries."""

    tenant_id: str
    tenant_name: str
    key_id: str
    scopes: frozenset[str]

    def allows(self, scope: str) -> bool:
        return "admin" in self.scopes or scope in self.scopes


def create_tenant(session: Session, name: str) -> Tenant:
    if session.scalar(select(Tenant).where(Tenant.name == name)) is not None:
        raise Conflict(f"tenant {name!r} already exists")
    tenant = Tenant(id=new_id(), name=name)
    session.add(tenant)
    session.flush()
    webhook_secrets.create(session, tenant.id)
    return tenant


def get_tenant_by_name(session: Session, name: str) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise NotFound(f"no tenant named {name!r}")
    return tenant


def create_key(session: Session, tenant: Tenant, scopes: tuple[str, ...] = DEFAULT_SCOPES) -> str:
    """Create an API key for ``tenant`` and return the key itself: the only time it is seen."""
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown:
        raise InvalidRequest("scope", f"unknown scope(s) {', '.join(unknown)}; known: {SCOPES}")
    key = new_api_key()
    session.add(
        ApiKey(
            id=new_id(),
            tenant_id=tenant.id,
            prefix=key[:10],
            key_hash=hash_secret(key),
            scopes=sorted(set(scopes)),
        )
    )
    session.flush()
    return key


def authenticate(session: Session, key: str) -> Principal | None:
    """The principal behind ``key``, or None if the key is unknown or revoked."""
    row = session.execute(
        select(ApiKey, Tenant.name)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(ApiKey.key_hash == hash_secret(key), ApiKey.revoked_at.is_(None))
    ).first()
    if row is None:
        return None
    api_key, tenant_name = row
    return Principal(
        tenant_id=api_key.tenant_id,
        tenant_name=tenant_name,
        key_id=api_key.id,
        scopes=frozenset(api_key.scopes),
    )
