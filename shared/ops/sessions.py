"""Dashboard sessions: an API key with the ``admin`` or ``operator`` scope exchanged, once, for
a random cookie. Only the cookie's hash is stored; the key itself is never kept, never put in
a URL and never shown again. A session ends at its expiry, on logout, or as soon as its key
is revoked or expires (every request re-reads the key's row)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from shared.errors import KeyRejected
from shared.ids import hash_secret
from shared.store.tables import ApiKey, DashboardSession, Tenant, utcnow
from shared.store.tenants import ADMIN, OPERATOR, Principal, verify_key
from shared.views import aware

LIFETIME = timedelta(hours=12)


@dataclass(frozen=True)
class Login:
    """A live dashboard session: who it is, and the token its forms must carry."""

    principal: Principal
    csrf_token: str
    expires_at: datetime

    @property
    def operator(self) -> bool:
        return OPERATOR in self.principal.scopes


def open_session(
    session: Session, key: str, *, lifetime: timedelta = LIFETIME
) -> tuple[str, Login]:
    """Verify ``key`` and start a session; returns the cookie's value and the login.

    KeyRejected if the key is not valid, or lacks both ``admin`` and ``operator``: a key that
    may only read or submit tasks cannot open the dashboard."""
    principal = verify_key(session, key)
    if not principal.scopes & {ADMIN, OPERATOR}:
        raise KeyRejected(
            "this API key cannot open the dashboard: it needs the admin scope (or operator). "
            f"Make one with: ratchet keys create --tenant {principal.tenant_name} --scope admin"
        )
    cookie = secrets.token_urlsafe(32)
    row = DashboardSession(
        id_hash=hash_secret(cookie),
        key_id=principal.key_id,
        csrf_token=secrets.token_urlsafe(32),
        created_at=utcnow(),
        expires_at=utcnow() + lifetime,
    )
    session.add(row)
    session.flush()
    return cookie, Login(principal, row.csrf_token, row.expires_at)


def resume(session: Session, cookie: str) -> Login | None:
    """The live session behind a cookie, or None: unknown, expired, or its key revoked or
    expired since the login."""
    row = session.execute(
        select(DashboardSession, ApiKey, Tenant.name)
        .join(ApiKey, ApiKey.id == DashboardSession.key_id)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(DashboardSession.id_hash == hash_secret(cookie))
    ).first()
    if row is None:
        return None
    login, key, tenant_name = row
    now = utcnow()
    ends = [login.expires_at, key.revoked_at, key.expires_at]
    if any((end := aware(e)) is not None and end <= now for e in ends):
        return None
    principal = Principal(
        tenant_id=key.tenant_id,
        tenant_name=tenant_name,
        key_id=key.id,
        scopes=frozenset(key.scopes),
    )
    return Login(principal, login.csrf_token, aware(login.expires_at) or login.expires_at)


def close(session: Session, cookie: str) -> None:
    """Log out: the cookie stops working at once. Expired sessions are dropped on the way."""
    session.execute(delete(DashboardSession).where(DashboardSession.id_hash == hash_secret(cookie)))
    session.execute(delete(DashboardSession).where(DashboardSession.expires_at <= utcnow()))
