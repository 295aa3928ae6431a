"""The audit log: who changed a tenant's secrets or MCP servers, and when (never a value).
Written in the transaction of the change it records."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.ids import new_id
from shared.store.tables import AuditEntry

CLI_ACTOR = "cli"


def actor_of_key(key_id: str) -> str:
    return f"key:{key_id}"


def record(session: Session, tenant_id: str, *, actor: str, action: str, target: str) -> None:
    session.add(
        AuditEntry(id=new_id(), tenant_id=tenant_id, actor=actor, action=action, target=target)
    )
    session.flush()


def list_for(session: Session, tenant_id: str, *, limit: int = 100) -> Sequence[AuditEntry]:
    """The tenant's latest entries, newest first."""
    return session.scalars(
        select(AuditEntry)
        .where(AuditEntry.tenant_id == tenant_id)
        .order_by(AuditEntry.at.desc(), AuditEntry.id.desc())
        .limit(limit)
    ).all()
