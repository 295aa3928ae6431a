"""What a person (over the API, the dashboard or a signed link) or the deadline can do to a
tool call that waits for approval: decide it, once.

Each is one transaction returning the ``Effects`` to send once it has committed."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from shared.actions.effects import NONE, Effects, of_task
from shared.approvals import decisions
from shared.approvals.decisions import Decided


def decide(
    session: Session,
    task_id: str,
    call_id: str,
    *,
    decision: str,
    decided_by: str,
    tenant_id: str | None,
    arguments: dict[str, Any] | None = None,
    reason: str | None = None,
) -> tuple[Decided, Effects]:
    """Record ``decision`` on the waiting call (see ``decisions.decide`` for who wins and
    what is refused). A decision made before is answered as stored, and sends nothing; the
    step's last one puts the task back in the backlog and wakes the dispatcher."""
    with session.begin():
        decided = decisions.decide(
            session,
            task_id,
            call_id,
            decision=decision,
            decided_by=decided_by,
            tenant_id=tenant_id,
            arguments=arguments,
            reason=reason,
        )
    if decided.replayed:
        return decided, NONE
    return decided, of_task(decided.task.id, decided.deliveries, wake=decided.resumed)


def expire(session: Session, task_id: str, call_id: str, policy: str) -> Effects:
    """Apply the deadline's ``policy`` to one call past its deadline, exactly once (nothing
    if a person's decision got there first); see ``decisions.expire``."""
    with session.begin():
        resumed, deliveries = decisions.expire(session, task_id, call_id, policy)
    # Its readers are woken even when nothing changed: a wake-up too many costs one read.
    return of_task(task_id, deliveries, wake=resumed)
