"""Shares of admission. How many due tasks a round reads of each tenant: ``PER_TENANT`` while
it does not know how many tenants wait, else an equal share of its budget (up to
``PER_TENANT_MAX``), so that a single busy tenant fills the window in a few rounds, not one per
32 tasks, and a round never reads more than a few times what it did. And how much of the fleet
a tenant may hold: with no limit of its own, its default share, so that another tenant's tasks
are admitted at once beside its flood (whichever way they come in, the backlog or the gate)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from shared.scheduling import admission, concurrency, lead
from shared.scheduling.admission import PER_TENANT, PER_TENANT_MAX, Rotation
from shared.store.db import transaction
from shared.store.tables import Task
from tests.conftest import TenantHandle
from tests.helpers import admit
from tests.integration.test_direct_admission import admitted_at_insert, leading
from tests.integration.test_scheduling import admitted, settings, submit


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
            limits=concurrency.cached(session),
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


@pytest.mark.backends("postgresql", "sqlite")
def test_a_tenant_with_no_limit_of_its_own_holds_at_most_its_share_of_the_fleet(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    hostile, other = make_tenant(), make_tenant()
    for _ in range(6):
        submit(client, hostile)
    with settings(dispatch_capacity=4, dispatch_window=4):  # 4 slots: half of them by default
        assert admit() == 2
        assert len(admitted(hostile)) == 2  # the flood, alone, still leaves half the fleet
        late = {submit(client, other) for _ in range(2)}
        assert admit() == 2
        assert admitted(other) == late  # at once, beside the flood
        assert admit() == 0  # the flood waits for its own slots, not the others'


@pytest.mark.backends("postgresql", "sqlite")
@pytest.mark.parametrize(
    ("values", "held"),
    [
        ({"concurrency": {"tenants": {"*": {"max_running": 3}}}}, 3),  # the operator's limit
        ({"tenant_default_share": "0.75"}, 3),  # the operator's share
        ({"tenant_default_share": "1"}, 4),  # no default share: what the fleet has room for
        ({"fair_scheduling": "false"}, 4),  # one FIFO: no share either
    ],
)
def test_the_operator_overrides_the_default_share(
    client: TestClient,
    make_tenant: Callable[..., TenantHandle],
    values: dict[str, object],
    held: int,
) -> None:
    hostile, _neighbour = make_tenant(), make_tenant()
    for _ in range(6):
        submit(client, hostile)
    with settings(dispatch_capacity=4, dispatch_window=4, **values):
        admit()
        assert len(admitted(hostile)) == held


@pytest.mark.backends("sqlite")  # a database of its own: no other test's tenants in it
def test_a_lone_tenant_has_the_whole_fleet_until_a_neighbour_comes(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    alone = make_tenant()
    with leading(dispatch_capacity=8, direct_admission="false") as dispatcher:
        for _ in range(4):
            submit(client, alone)
        assert len(dispatcher.round().admitted) == 4  # no neighbour: no room is kept for one
        make_tenant()  # and at once, in the very next round, the share (4 of 8) holds
        for _ in range(4):
            submit(client, alone)
        assert dispatcher.round().admitted == []
        assert len(admitted(alone)) == 4


@pytest.mark.backends("sqlite")  # a database of its own: no other test's tenants in it
def test_a_lone_tenants_gate_holds_only_its_share_so_a_neighbour_finds_room(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    """A lone tenant has the whole fleet through the rounds, but only its share directly: a
    gate opened before a neighbour came must not let its flood take the fleet."""
    alone = make_tenant()
    with leading(dispatch_capacity=8) as dispatcher:
        assert dispatcher.round().spare == 4
        make_tenant()  # a neighbour, before the next round
        flood = [submit(client, alone) for _ in range(6)]
        assert sum(admitted_at_insert(t) for t in flood) == 4
        assert dispatcher.round().admitted == []  # and the round keeps its share
        assert len(admitted(alone)) == 4


@pytest.mark.backends("postgresql", "sqlite")
def test_the_gate_never_lets_a_tenant_past_its_share(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    hostile, other = make_tenant(), make_tenant()
    with leading(dispatch_capacity=8) as dispatcher:  # a share of 4 slots
        assert dispatcher.round().spare == 4  # the fleet has 8 free slots, a tenant 4
        flood = [submit(client, hostile) for _ in range(6)]
        assert sum(admitted_at_insert(t) for t in flood) == 4  # its share through the gate
        found = dispatcher.round()
        assert (found.admitted, found.spare) == ([], 0)  # at its share: nothing goes direct
        late = submit(client, other)
        assert not admitted_at_insert(late)
        assert [t for t, _ in dispatcher.round().admitted] == [late]  # by the backlog, at once
        assert len(admitted(hostile)) == 4
