"""What a client can do with a task's history: fork it from one of its committed steps.

One transaction that creates the fork with its inherited steps and returns it with the
``Effects`` to send once it has committed (``effects.after_commit``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session

from shared.actions.effects import of_task
from shared.actions.tasks import DirectSlot, Submitted, submit_once
from shared.scheduling import caps
from shared.store import forks, tasks
from shared.store.db import get_sessionmaker
from shared.store.tasks import NewTask


def fork_task(
    tenant_id: str,
    tenant_name: str,
    spec: NewTask,
    *,
    tool_results: Mapping[str, Any] | None = None,
    idempotency_key: str | None = None,
    request_hash: str,
) -> Submitted:
    """Create ``spec``, a fork of ``spec.forked_from``'s task (the tenant's, else NotFound):
    a queued task holding copies of that task's steps up to the fork point, which goes on at
    the step after it. The origin is only read (its committed rows), in any state.

    Refused with InvalidRequest when the fork point is past the origin's committed steps or
    a replaced tool result names no call of that step, and as a submission is (the tenant's
    queue cap; an Idempotency-Key finds the fork it made before, IdempotencyMismatch for a
    different body, Conflict while a concurrent request with it has not committed). Nothing
    is written unless the whole fork is."""
    point = spec.forked_from
    assert point is not None

    def insert(session: Session, _: DirectSlot) -> Submitted:  # a fork takes no gate slot
        tasks.get_task(session, tenant_id, point.task_id)  # NotFound across tenants
        forks.check_fork_point(session, point.task_id, point.step, tool_results=tool_results or {})
        caps.check(session, tenant_id, tenant_name)
        logged = tasks.create_task(
            session,
            tenant_id,
            spec,
            idempotency_key=idempotency_key,
            request_hash=request_hash,
        )
        forks.copy_history(
            session,
            source=point.task_id,
            target=logged.task.id,
            through_step=point.step,
            tool_results=tool_results,
        )
        # Into the backlog, as any task the dispatcher admits: its first message is for the
        # step after the fork point (the dispatcher sends the task's next step).
        effects = of_task(logged.task.id, logged.deliveries, wake=True)
        return Submitted(logged.task, created=True, effects=effects)

    with get_sessionmaker()() as session:
        return submit_once(
            session,
            tenant_id,
            idempotency_key=idempotency_key,
            request_hash=request_hash,
            insert=insert,
        )
