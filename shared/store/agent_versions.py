"""The agent versions tasks ran with: written once per distinct definition, never changed,
listed per agent newest first."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import exists, or_, select
from sqlalchemy.orm import Session

from shared.errors import NotFound
from shared.store.backends import upsert
from shared.store.tables import AgentVersion, utcnow

# A page's place in a list: the last row's (created_at, id).
Position = tuple[datetime, str]


def insert_if_absent(
    session: Session, *, version_id: str, agent: str, definition: dict[str, Any]
) -> None:
    """The version's row, unless it is there already. Its id is the hash of ``definition``,
    so a row found under it holds the same definition: concurrent writers of one version
    (several API processes after a deploy) leave one row, the first one's."""
    statement = (
        upsert(session, AgentVersion.__table__)
        .values(id=version_id, agent=agent, definition=definition, created_at=utcnow())
        .on_conflict_do_nothing(index_elements=["id"])
    )
    session.execute(statement)


def find_version(session: Session, version_id: str) -> AgentVersion | None:
    return session.get(AgentVersion, version_id)


def get_version(session: Session, agent: str, version_id: str) -> AgentVersion:
    """Version ``version_id`` of ``agent`` (NotFound for another agent's, or none)."""
    found = session.get(AgentVersion, version_id)
    if found is None or found.agent != agent:
        raise NotFound(f"agent {agent!r} has no version {version_id}")
    return found


def has_versions(session: Session, agent: str) -> bool:
    return bool(session.scalar(select(exists().where(AgentVersion.agent == agent))))


def list_versions(
    session: Session, agent: str, *, limit: int, after: Position | None = None
) -> tuple[Sequence[AgentVersion], Position | None]:
    """A page of ``agent``'s versions, newest first (by when each was first submitted, then
    by id), and the position to continue after (or None on the last page)."""
    query = select(AgentVersion).where(AgentVersion.agent == agent)
    if after is not None:
        at, version_id = after
        query = query.where(
            or_(
                AgentVersion.created_at < at,
                (AgentVersion.created_at == at) & (AgentVersion.id < version_id),
            )
        )
    order = (AgentVersion.created_at.desc(), AgentVersion.id.desc())
    rows = session.scalars(query.order_by(*order).limit(limit + 1)).all()
    more = len(rows) > limit
    last = rows[limit - 1] if more else None
    return rows[:limit], (last.created_at, last.id) if last is not None else None
