"""What a tenant admin (over the API or the dashboard) can do to its tenant's API keys:
create, revoke and rotate them, each one transaction. A key acts only on keys with no more
power than its own: an operator key is beyond a tenant admin's (the CLI manages those)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from shared.errors import RatchetError
from shared.store import tenants
from shared.store.tables import ApiKey
from shared.store.tenants import OPERATOR


class BeyondReach(RatchetError):
    """The key is an operator key and the caller's is not."""


def create_key(
    session: Session,
    tenant_id: str,
    *,
    scopes: Sequence[str],
    name: str | None,
    expires_at: datetime | None = None,
    cap: int | None = None,
) -> tuple[ApiKey, str]:
    """A new key of the tenant's and its secret, shown this once (Conflict past ``cap`` live
    keys)."""
    with session.begin():
        return tenants.issue_key(
            session, tenant_id, scopes=list(scopes), name=name, expires_at=expires_at, cap=cap
        )


def revoke_key(session: Session, tenant_id: str, key_id: str, *, operator: bool) -> ApiKey:
    """Revoke the key now (BeyondReach for an operator key, unless ``operator``)."""
    with session.begin():
        if not operator and OPERATOR in tenants.get_key(session, tenant_id, key_id).scopes:
            raise BeyondReach("an operator key is revoked only by an operator or the CLI")
        return tenants.revoke_key(session, tenant_id, key_id)


def rotate_key(
    session: Session, tenant_id: str, key_id: str, *, grace: timedelta
) -> tuple[ApiKey, str]:
    """A new key in place of a live one, which stops working after ``grace`` (BeyondReach for
    an operator key: rotated only with the CLI)."""
    with session.begin():
        if OPERATOR in tenants.get_key(session, tenant_id, key_id).scopes:
            raise BeyondReach("an operator key is rotated only with the ratchet CLI")
        return tenants.rotate_key(session, tenant_id, key_id, grace=grace)
