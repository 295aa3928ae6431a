"""Queue caps: a tenant may have at most ``max_queued`` tasks queued (submitted, not yet
started). Past it, a submission is refused (429 with Retry-After) and creates nothing.

The count and the insert are in one transaction, serialized per tenant (the tenant's lock of
queued tasks, held till it ends: ``shared.store.backends.hold_tenant_lock``), so concurrent
submissions never take a tenant past its cap. Without a cap, nothing is counted.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from shared.errors import QueueFull
from shared.scheduling import concurrency
from shared.statuses import TaskStatus
from shared.store.backends import hold_tenant_lock
from shared.store.tables import Task

RETRY_AFTER_SECONDS = 5
QUEUE_LOCK_NAMESPACE = 0x5251  # "RQ": the advisory locks of tenants' queues


def known_uncapped(tenant_name: str) -> bool:
    """Whether the tenant has no cap, known without reading the database (from limits read
    within the last second): then a submission counts nothing and locks nothing."""
    cached = concurrency.peek()
    return cached is not None and cached.tenant(tenant_name).max_queued is None


def check(session: Session, tenant_id: str, tenant_name: str, *, adding: int = 1) -> None:
    """In the submission's transaction, before its insert of ``adding`` tasks: QueueFull if
    they would take the tenant past its cap (a batch is refused whole, not cut short)."""
    cap = concurrency.cached(session).tenant(tenant_name).max_queued
    if cap is None:
        return
    hold_tenant_lock(session, tenant_id, namespace=QUEUE_LOCK_NAMESPACE)
    queued = session.scalar(
        select(func.count())
        .select_from(Task)
        .where(Task.tenant_id == tenant_id, Task.status == TaskStatus.QUEUED)
    )
    if (queued or 0) + adding > cap:
        held = "its most" if adding == 1 else f"and {adding} more would pass its most"
        raise QueueFull(
            f"tenant {tenant_name!r} has {queued} tasks queued, {held} (max_queued {cap}); "
            f"retry once some have started",
            retry_after_s=RETRY_AFTER_SECONDS,
        )
