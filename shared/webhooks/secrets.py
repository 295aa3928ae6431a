"""Each tenant's webhook signing secrets: created with the tenant, rotatable with an overlap.

During the overlap both the new and the old secret sign every message (two signatures in
``webhook-signature``), so a receiver can switch secrets without missing a message.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from shared.ids import new_id
from shared.store.tables import WebhookSecret, utcnow
from shared.webhooks.signing import new_secret


def create(session: Session, tenant_id: str) -> str:
    secret = new_secret()
    session.add(WebhookSecret(id=new_id(), tenant_id=tenant_id, secret=secret))
    session.flush()
    return secret


def signing(session: Session, tenant_id: str) -> list[str]:
    """The secrets that sign right now, newest first."""
    now = utcnow()
    rows = session.scalars(
        select(WebhookSecret)
        .where(WebhookSecret.tenant_id == tenant_id)
        .where(WebhookSecret.expires_at.is_(None) | (WebhookSecret.expires_at > now))
        .order_by(WebhookSecret.created_at.desc())
    ).all()
    return [row.secret for row in rows]


def current(session: Session, tenant_id: str) -> str:
    live = signing(session, tenant_id)
    return live[0] if live else create(session, tenant_id)


def rotate(session: Session, tenant_id: str, *, overlap: timedelta) -> str:
    """A new current secret; the ones before it keep signing for ``overlap``, then expire."""
    session.execute(
        update(WebhookSecret)
        .where(WebhookSecret.tenant_id == tenant_id, WebhookSecret.expires_at.is_(None))
        .values(expires_at=utcnow() + overlap)
        .execution_options(synchronize_session=False)
    )
    return create(session, tenant_id)
