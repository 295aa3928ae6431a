"""How many due tasks an admission round reads of each tenant: ``PER_TENANT`` while it does
not know how many tenants wait, else an equal share of its budget (up to ``PER_TENANT_MAX``),
so that a single busy tenant fills the window in a few rounds, not one per 32 tasks, and a
round never reads more than a few times what it did."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from shared.scheduling import admission, lead, limits
from shared.scheduling.admission import PER_TENANT, PER_TENANT_MAX, Rotation
from shared.store.db import transaction
from shared.store.tables import Task
from tests.conftest import TenantHandle
from tests.integration.test_scheduling import submit


@pytest.mark.parametrize(
    ("tenants_read", "budget", "expected"),
    [
        (0, 256, PER_TENANT),  # the first round: how many wait is not known
        (1, 256, PER_TENANT_MAX),  # one tenant: as much as a round may read of it
        (2, 256, PER_TENANT_MAX),
        (4, 256, 64),  # an equal share of the budget
        (8, 256, PER_TENANT),
        (100, 256, PER_TENANT),  # never less than before
        (1, 10, 10),  # never more than the budget
    ],
)
def test_a_round_reads_each_tenant_for_its_share_of_the_budget(
    tenants_read: int, budget: int, expected: int
) -> None:
    rotation = Rotation(tenants_read=tenants_read)
    assert rotation.per_tenant(budget) == expected


def _round(rotation: Rotation) -> int:
    with transaction() as session:
        lead.lock_round(session)
        found = admission.admission_round(
            session,
            limits=limits.cached(session),
            capacity=1000,
            window=256,
            fair=True,
            rotation=rotation,
        )
    return len(found.admitted)


@pytest.mark.backends("postgresql")
def test_a_single_busy_tenant_is_read_for_the_whole_share_after_the_first_round(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    tenant = make_tenant()
    for _ in range(200):
        submit(client, tenant)
    rotation = Rotation()

    assert _round(rotation) == PER_TENANT  # one tenant read: it learns that
    assert _round(rotation) == PER_TENANT_MAX
    assert _round(rotation) == 200 - PER_TENANT - PER_TENANT_MAX
    assert _round(rotation) == 0
    assert rotation.tenants_read == 1  # kept for the next burst: it starts at the share
    with transaction() as session:
        waiting = select(func.count()).where(
            Task.tenant_id == tenant.id, Task.admitted_ms.is_(None)
        )
        assert session.scalar(waiting) == 0
