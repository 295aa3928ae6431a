"""Tenants and their API keys. Keys are stored hashed and shown once, at creation.

Scopes nest: ``operator`` (fleet-wide views and actions, granted only by the CLI) implies
``admin`` (the tenant's own keys, secrets and settings), which implies every ``tasks:*``
scope. A key never reaches another tenant's rows, whatever its scopes.

A key stops working the moment its ``revoked_at`` passes: at once for a revoke, after the
grace period for a rotation. Its ``last_used_at`` is written at most once a minute.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from shared.errors import Conflict, InvalidRequest, KeyRejected, NotFound
from shared.ids import hash_secret, new_api_key, new_id
from shared.store.tables import ApiKey, Tenant, utcnow
from shared.webhooks import secrets as webhook_secrets

OPERATOR = "operator"
ADMIN = "admin"
WRITE = "tasks:write"
APPROVE = "tasks:approve"
TENANT_SCOPES = ("tasks:read", "tasks:write", "tasks:approve", ADMIN)
SCOPES = (*TENANT_SCOPES, OPERATOR)
DEFAULT_SCOPES = ("tasks:read", "tasks:write")
# The shape of every key ids.new_api_key makes: "rk_" and 32 random bytes, base64url.
KEY_FORMAT = re.compile(r"rk_[A-Za-z0-9_-]{43}", re.ASCII)
LAST_USED_RESOLUTION = timedelta(seconds=60)
MAX_ROTATION_GRACE = timedelta(days=7)


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant and the scopes its key carries."""

    tenant_id: str
    tenant_name: str
    key_id: str
    scopes: frozenset[str]

    def allows(self, scope: str) -> bool:
        if scope in self.scopes or OPERATOR in self.scopes:
            return True
        if scope == APPROVE and WRITE in self.scopes:  # who may submit may decide; not vice versa
            return True
        return ADMIN in self.scopes and scope != OPERATOR


# --- tenants ----------------------------------------------------------------------------------


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


def list_tenants(session: Session) -> list[Tenant]:
    return list(session.scalars(select(Tenant).order_by(Tenant.name)))


def count_tenants(session: Session) -> int:
    return session.scalar(select(func.count()).select_from(Tenant)) or 0


# --- keys -------------------------------------------------------------------------------------


def check_scopes(scopes: tuple[str, ...] | list[str]) -> list[str]:
    """The scopes sorted and deduplicated; InvalidRequest naming any unknown one."""
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown:
        raise InvalidRequest("scopes", f"unknown scope(s) {', '.join(unknown)}; known: {SCOPES}")
    if not scopes:
        raise InvalidRequest("scopes", "a key needs at least one scope")
    return sorted(set(scopes))


def issue_key(
    session: Session,
    tenant_id: str,
    *,
    scopes: tuple[str, ...] | list[str] = DEFAULT_SCOPES,
    name: str | None = None,
    expires_at: datetime | None = None,
    cap: int | None = None,
) -> tuple[ApiKey, str]:
    """A new key for the tenant: its row and the key itself, which is never seen again.

    With ``cap``, Conflict if the tenant already holds that many live keys: counted under a
    lock on the tenant's row, so concurrent creations cannot pass the cap together."""
    if expires_at is not None and expires_at <= utcnow():
        raise InvalidRequest("expires_at", "must be in the future")
    if cap is not None and live_key_count(session, tenant_id, lock=True) >= cap:
        raise Conflict(
            f"the tenant holds {cap} live API keys, its most: revoke one it no longer uses "
            "(RATCHET_MAX_KEYS_PER_TENANT)"
        )
    key = new_api_key()
    row = ApiKey(
        id=new_id(),
        tenant_id=tenant_id,
        prefix=key[:10],
        key_hash=hash_secret(key),
        scopes=check_scopes(scopes),
        name=name,
        created_at=utcnow(),
        expires_at=expires_at,
    )
    session.add(row)
    session.flush()
    return row, key


def create_key(
    session: Session,
    tenant: Tenant,
    scopes: tuple[str, ...] = DEFAULT_SCOPES,
    *,
    name: str | None = None,
    expires_at: datetime | None = None,
) -> str:
    """Create an API key for ``tenant`` and return the key itself: the only time it is seen."""
    return issue_key(session, tenant.id, scopes=scopes, name=name, expires_at=expires_at)[1]


def list_keys(
    session: Session, tenant_id: str, *, after: str | None = None, limit: int = 100
) -> list[ApiKey]:
    """The tenant's keys, newest first (ids are time-ordered), revoked ones included."""
    query = select(ApiKey).where(ApiKey.tenant_id == tenant_id)
    if after is not None:
        query = query.where(ApiKey.id < after)
    return list(session.scalars(query.order_by(ApiKey.id.desc()).limit(limit)))


def live_key_count(session: Session, tenant_id: str, *, lock: bool = False) -> int:
    """The tenant's keys that still work (neither revoked nor expired). ``lock``: first lock
    the tenant's row until the transaction ends (PostgreSQL; SQLite has one writer anyway)."""
    if lock:
        session.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
    now = utcnow()
    count = session.scalar(
        select(func.count())
        .select_from(ApiKey)
        .where(
            ApiKey.tenant_id == tenant_id,
            or_(ApiKey.revoked_at.is_(None), ApiKey.revoked_at > now),
            or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now),
        )
    )
    return count or 0


def get_key(session: Session, tenant_id: str, key_id: str) -> ApiKey:
    """The tenant's key ``key_id``; another tenant's key is NotFound, like a missing one."""
    row = session.scalar(select(ApiKey).where(ApiKey.id == key_id, ApiKey.tenant_id == tenant_id))
    if row is None:
        raise NotFound(f"no API key {key_id}")
    return row


def revoke_key(session: Session, tenant_id: str, key_id: str) -> ApiKey:
    """Revoke the key now; the next request with it is refused. Revoking twice is harmless,
    and revoking a key in its rotation grace period ends the grace at once."""
    row = get_key(session, tenant_id, key_id)
    now = utcnow()
    if row.revoked_at is None or _utc(row.revoked_at) > now:
        row.revoked_at = now
        session.flush()
    return row


def rotate_key(
    session: Session, tenant_id: str, key_id: str, *, grace: timedelta = timedelta(0)
) -> tuple[ApiKey, str]:
    """A new key with the old one's name, scopes and lifetime; the old one stops working
    after ``grace`` (at most a week), so clients can switch over without a failed request.
    Only a live key rotates: a revoked, rotated or expired one is a Conflict (rotating it
    would bring a dead key's powers back to life)."""
    if not timedelta(0) <= grace <= MAX_ROTATION_GRACE:
        raise InvalidRequest("grace_seconds", f"must be between 0 and {MAX_ROTATION_GRACE}")
    old = get_key(session, tenant_id, key_id)
    if old.revoked_at is not None:
        raise Conflict(f"API key {key_id} is revoked or already rotated")
    now = utcnow()
    if old.expires_at is not None and _utc(old.expires_at) <= now:
        raise Conflict(f"API key {key_id} expired at {_utc(old.expires_at)}: create a new one")
    expires_at = None
    if old.expires_at is not None:
        expires_at = now + (_utc(old.expires_at) - _utc(old.created_at))
    old.revoked_at = now + grace
    return issue_key(session, tenant_id, scopes=old.scopes, name=old.name, expires_at=expires_at)


def verify_key(session: Session, key: str) -> Principal:
    """The principal behind ``key``; KeyRejected, saying why, if it may not be used.

    Records the key's use, but writes at most once a minute per key: the row just read
    says when the last write was, so most requests issue no UPDATE at all."""
    if not KEY_FORMAT.fullmatch(key):
        raise KeyRejected("the API key is not valid")
    row = session.execute(
        select(ApiKey, Tenant.name)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(ApiKey.key_hash == hash_secret(key))
    ).first()
    if row is None:
        raise KeyRejected("the API key is not valid")
    api_key, tenant_name = row
    now = utcnow()
    if api_key.revoked_at is not None and _utc(api_key.revoked_at) <= now:
        raise KeyRejected(f"the API key {api_key.prefix}… was revoked")
    if api_key.expires_at is not None and _utc(api_key.expires_at) <= now:
        raise KeyRejected(f"the API key {api_key.prefix}… expired at {_utc(api_key.expires_at)}")
    _record_use(session, api_key, now)
    return Principal(
        tenant_id=api_key.tenant_id,
        tenant_name=tenant_name,
        key_id=api_key.id,
        scopes=frozenset(api_key.scopes),
    )


def _utc(value: datetime) -> datetime:
    """SQLite hands back naive datetimes; every time Ratchet stores is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _record_use(session: Session, api_key: ApiKey, now: datetime) -> None:
    stale = now - LAST_USED_RESOLUTION
    if api_key.last_used_at is not None and _utc(api_key.last_used_at) >= stale:
        return
    # Conditional, so API processes racing past the same minute write it once between them.
    session.execute(
        update(ApiKey)
        .where(ApiKey.id == api_key.id)
        .where(or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < stale))
        .values(last_used_at=now)
        .execution_options(synchronize_session=False)
    )


def authenticate(session: Session, key: str) -> Principal | None:
    """The principal behind ``key``, or None if it may not be used (unknown, revoked, expired)."""
    try:
        return verify_key(session, key)
    except KeyRejected:
        return None
