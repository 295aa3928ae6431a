"""Admission: which waiting tasks go to the Celery queue now.

PostgreSQL holds the backlog: a runnable task that is not admitted (``admitted_ms`` NULL)
waits there, whatever it waits for (its first step, a backoff that ended, a decision). Each
round the dispatcher admits as many as the fleet has room for, and no more than
``RATCHET_DISPATCH_WINDOW`` waiting in the broker, so the broker's queue stays short and the
order of admission is Ratchet's:

- **round-robin across tenants** (weighted): each tenant with work due gets its turn, the one
  served longest ago first, so a tenant with one task waits about one round whatever the
  others have queued;
- **by priority, then due time, within a tenant**: priority never crosses tenants;
- **within every limit**: a task is admitted only while its tenant, its agent and each pool it
  belongs to has a free slot. Admitted tasks (running, or with a message on its way) hold the
  slots; a task that waits (rate limit, backoff, approval) gives its slot back. A tenant with
  no limit of its own holds at most its default share of the fleet (``share``, in slots), so
  that a flood of slow tasks leaves room for the others' at once.

An admitted task keeps its slot from step to step: a step that may continue at once does so
on the worker (or by a direct message), never through the dispatcher. And with direct
admission on, a task submitted while nothing waits for room skips the backlog
(``shared.scheduling.gate``).

Admission is one UPDATE (``admitted_ms`` set, due now: ``shared.store.tasks.admit_waiting``)
committed before the messages are sent. A dispatcher that dies in between leaves admitted
tasks without a message: the sweeper sends them one, as for any lost message. The UPDATE only
takes tasks still waiting, so two dispatchers (briefly, in a failover) never admit a task
twice; and a lease is what lets a step run, whatever the messages.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from shared.scheduling.concurrency import Limits
from shared.statuses import TaskStatus
from shared.store.backends import first_per_tenant, scan_index_entries
from shared.store.db import now_ms
from shared.store.tables import Task, Tenant, runnable
from shared.store.tasks import admit_waiting

PER_TENANT = 32  # candidates read per tenant and round: at most this many admitted each
# ... unless the last round read fewer tenants than its budget had room for: then each is
# read for an equal share of the budget, up to this many (a single busy tenant fills the
# window in two rounds rather than eight; a round reads at most four times what it did).
PER_TENANT_MAX = 128


@dataclass(frozen=True)
class Candidate:
    id: str
    tenant_id: str
    tenant: str
    agent: str
    model: str
    steps: int


@dataclass
class Use:
    """What is admitted now: slots held per tenant, agent and pool, and how many of them are
    still a message in the broker (admitted, not yet leased)."""

    total: int = 0
    in_queue: int = 0
    tenants: Counter[str] = field(default_factory=Counter)  # by tenant name
    agents: Counter[str] = field(default_factory=Counter)
    pools: Counter[str] = field(default_factory=Counter)

    def add(self, limits: Limits, *, tenant: str, agent: str, model: str, n: int = 1) -> None:
        self.total += n
        self.tenants[tenant] += n
        self.agents[agent] += n
        for pool in limits.pools_of(tenant=tenant, agent=agent, model=model):
            self.pools[pool] += n


def in_use(session: Session, limits: Limits) -> Use:
    """The admitted tasks, counted by what limits them (through ``ix_tasks_admitted``)."""
    clock = now_ms()
    leased = case((Task.lease_expires_ms > clock, 1), else_=0)
    rows = session.execute(
        select(Tenant.name, Task.agent, Task.model, func.count(), func.sum(leased))
        .join(Tenant, Tenant.id == Task.tenant_id)
        .where(Task.admitted_ms.is_not(None), runnable())
        .group_by(Tenant.name, Task.agent, Task.model)
    ).all()
    use = Use()
    for tenant, agent, model, count, leased_count in rows:
        use.add(limits, tenant=tenant, agent=agent, model=model, n=int(count))
        use.in_queue += int(count) - int(leased_count or 0)
    return use


def _waiting() -> Any:
    return Task.admitted_ms.is_(None) & runnable() & (Task.due_ms <= now_ms())


def candidates(session: Session, *, per_tenant: int, fair: bool) -> list[Candidate]:
    """The tasks due to run, each tenant's first ``per_tenant`` in the order it is admitted
    (fair); or (not fair) the first ones of everyone's, by priority and due time alone."""
    columns = (Task.id, Task.tenant_id, Task.agent, Task.model, Task.steps)
    order = (Task.priority.desc(), Task.due_ms, Task.id)
    if fair:
        query = first_per_tenant(session, columns, where=_waiting(), order=order, limit=per_tenant)
    else:
        query = (
            select(*columns, Tenant.name)
            .join(Tenant, Tenant.id == Task.tenant_id)
            .where(_waiting())
            .order_by(*order)
            .limit(per_tenant)
        )
    return [
        Candidate(row.id, row.tenant_id, row.name, row.agent, row.model, row.steps)
        for row in session.execute(query).all()
    ]


@dataclass
class Rotation:
    """Whose turn it is: tenants served longest ago go first (kept by the dispatcher)."""

    served: dict[str, int] = field(default_factory=dict)
    _tick: itertools.count[int] = field(default_factory=itertools.count)
    tenants_read: int = 0  # how many tenants the last round that read any read due tasks of

    def per_tenant(self, budget: int) -> int:
        """How many due tasks of each tenant a round of ``budget`` reads."""
        share = budget // self.tenants_read if self.tenants_read else PER_TENANT
        return min(budget, max(PER_TENANT, min(share, PER_TENANT_MAX)))

    def order(self, tenant_ids: Sequence[str]) -> list[str]:
        return sorted(tenant_ids, key=lambda t: (self.served.get(t, -1), t))

    def serve(self, tenant_id: str) -> None:
        self.served[tenant_id] = next(self._tick)


def choose(
    found: Sequence[Candidate],
    *,
    limits: Limits,
    use: Use,
    budget: int,
    fair: bool,
    rotation: Rotation,
    share: int | None = None,
) -> list[Candidate]:
    """Pick up to ``budget`` of ``found``: round-robin over tenants (weighted), each tenant's
    in its order, every pick within its limits (``share``: a tenant's default most, in
    slots). Updates ``use`` and ``rotation``."""
    queues: dict[str, list[Candidate]] = defaultdict(list)
    for candidate in found:
        queues[candidate.tenant_id if fair else ""].append(candidate)
    picked: list[Candidate] = []
    while budget > 0 and queues:
        for key in rotation.order(list(queues)) if fair else [""]:
            queue = queues[key]
            turns = limits.tenant(queue[0].tenant).weight if fair else budget
            while turns > 0 and budget > 0 and queue:
                candidate = queue.pop(0)
                if not _room(candidate, limits, use, share=share):
                    continue
                use.add(
                    limits, tenant=candidate.tenant, agent=candidate.agent, model=candidate.model
                )
                picked.append(candidate)
                turns, budget = turns - 1, budget - 1
                if fair:
                    rotation.serve(key)
            if not queue or budget <= 0:
                queues.pop(key, None)
    return picked


def _room(candidate: Candidate, limits: Limits, use: Use, *, share: int | None) -> bool:
    tenant_max = limits.max_running(candidate.tenant, share=share)
    if tenant_max is not None and use.tenants[candidate.tenant] >= tenant_max:
        return False
    agent = limits.agent(candidate.agent)
    if agent is not None and use.agents[candidate.agent] >= agent.max_running:
        return False
    for pool in limits.pools_of(
        tenant=candidate.tenant, agent=candidate.agent, model=candidate.model
    ):
        if use.pools[pool] >= limits.config.pools[pool].max_running:
            return False
    return True


@dataclass(frozen=True)
class Round:
    admitted: list[tuple[str, int]]
    waiting: bool  # tasks were due that this round left waiting (no room, or no budget)
    more: bool = False  # budget is left and a tenant had more than this round read of it
    # The budget left when every due task read was admitted or is held back by a limit of
    # its own: so many new tasks under no limit would be admitted at once (see
    # shared.scheduling.gate); 0 when a due task waits for room. With a default share, never
    # more than the busiest tenant under it may still take: whoever takes the gate's slots,
    # no tenant goes past its share.
    spare: int = 0


def admission_round(
    session: Session,
    *,
    limits: Limits,
    capacity: int,
    window: int,
    fair: bool,
    rotation: Rotation,
    share: int | None = None,
    gate_share: int | None = None,
    unseen: int = 0,
) -> Round:
    """One round: count what is admitted, read what is due, choose, admit (not committed).
    ``share``: the most a tenant with no ``max_running`` of its own may hold (None: no
    default share). ``gate_share``: the same for the slots the round leaves to the gate,
    which a tenant's submissions may take before another tenant has anything to be counted
    (a lone tenant has the whole fleet through the rounds, but only its share directly).
    ``unseen``: tasks admitted by their own INSERTs lately (the direct path), which this
    round may not see yet: held back from the fleet's room and the broker's window, and
    counted as any one tenant's against its share."""
    scan_index_entries(session)  # the admitted tasks' index churns
    use = in_use(session, limits)
    budget = min(capacity - use.total, window - use.in_queue) - unseen
    if share is not None:
        share = max(0, share - unseen)
    if gate_share is not None:
        gate_share = max(0, gate_share - unseen)
    if budget <= 0:
        return Round([], waiting=True)
    per_tenant = rotation.per_tenant(budget) if fair else budget
    found = candidates(session, per_tenant=per_tenant, fair=fair)
    picked = choose(
        found, limits=limits, use=use, budget=budget, fair=fair, rotation=rotation, share=share
    )
    admitted = admit_waiting(session, [c.id for c in picked])
    read = Counter(c.tenant_id for c in found)
    if read:  # an empty round says nothing of how many tenants the next burst comes from
        rotation.tenants_read = len(read)
    capped = any(n >= per_tenant for n in read.values())
    more = capped and len(admitted) < budget and len(picked) == len(found)
    unread = capped if fair else len(found) >= per_tenant  # maybe more due than was read
    spare = 0 if unread else _within_share(budget - len(picked), limits, use, share=gate_share)
    return Round(admitted, waiting=len(found) > len(admitted), more=more, spare=spare)


def _within_share(spare: int, limits: Limits, use: Use, *, share: int | None) -> int:
    """``spare``, cut to what the busiest tenant under the default share may still take: the
    gate does not know who takes its slots (a tenant under a limit of its own never does)."""
    if share is None:
        return spare
    held = [n for t, n in use.tenants.items() if limits.tenant(t).max_running is None]
    return max(0, min(spare, share - max(held, default=0)))


def backlog_by_tenant(session: Session) -> dict[str, tuple[int, int]]:
    """Per tenant name: tasks waiting in the backlog (due or not), and queued tasks."""
    rows = session.execute(
        select(
            Tenant.name,
            func.count(),
            func.sum(case((Task.status == TaskStatus.QUEUED, 1), else_=0)),
        )
        .join(Tenant, Tenant.id == Task.tenant_id)
        .where(Task.admitted_ms.is_(None), runnable())
        .group_by(Tenant.name)
    ).all()
    return {name: (int(count), int(queued or 0)) for name, count, queued in rows}
