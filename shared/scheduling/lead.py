"""Leading a fleet-wide duty: one process at a time holds a row's lease (database clock) and
renews it while it lives; once it runs out (the process died, or froze), any other process
may take it. The lease decides who does the work; what the work writes is guarded on its own
(the dispatch's rounds take a transaction-scoped lock, its admissions are conditional), so a
leader that froze past its lease and wakes up does no harm in the moment before it notices.
"""

from __future__ import annotations

from sqlalchemy import delete
from sqlalchemy.orm import Session

from shared.store.backends import hold_lock, upsert
from shared.store.db import now_ms
from shared.store.tables import Leader

ROUND_LOCK_ID = 0x5244495350  # "RDISP": one dispatch round at a time across the fleet


def claim(session: Session, name: str, owner: str, *, ttl_ms: int) -> bool:
    """Take or renew ``name``'s lease for ``owner``; whether ``owner`` holds it now."""
    values = {"name": name, "owner": owner, "expires_ms": now_ms() + ttl_ms}
    statement = (
        upsert(session, Leader)
        .values(values)
        .on_conflict_do_update(
            index_elements=[Leader.name],
            set_={"owner": owner, "expires_ms": now_ms() + ttl_ms},
            where=(Leader.owner == owner) | (Leader.expires_ms < now_ms()),
        )
        .returning(Leader.owner)
    )
    return bool(session.scalar(statement) == owner)


def holder(session: Session, name: str) -> Leader | None:
    return session.get(Leader, name)


def lock_round(session: Session) -> None:
    """Wait for any other round in flight to commit; hold the round's lock till this one
    does."""
    hold_lock(session, ROUND_LOCK_ID)


def release(session: Session, name: str, owner: str) -> None:
    """Give the lease up (a process stopping): another process may take it at once."""
    session.execute(delete(Leader).where(Leader.name == name, Leader.owner == owner))
