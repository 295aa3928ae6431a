"""The store's database boundary: what each backend does its own way gives the same answer on
PostgreSQL and on SQLite (each tenant's first tasks, a lease row taken or refused), and the
locks that serialize writers on PostgreSQL hold till the transaction ends, one per tenant."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, text
from sqlalchemy.exc import OperationalError

from shared.scheduling import lead
from shared.store import backends
from shared.store.db import get_sessionmaker, transaction
from shared.store.tables import Task
from tests.conftest import TenantHandle
from tests.integration.test_scheduling import submit


@pytest.mark.backends("postgresql", "sqlite")
def test_each_tenants_first_tasks_come_in_its_order_on_either_database(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    busy, quiet = make_tenant(), make_tenant()
    busy_ids = [submit(client, busy, priority=p) for p in (0, 5, 1, 5, 3)]
    quiet_ids = [submit(client, quiet)]
    with transaction() as session:
        query = backends.first_per_tenant(
            session,
            (Task.id, Task.tenant_id),
            where=Task.tenant_id.in_([busy.id, quiet.id]),
            order=(Task.priority.desc(), Task.id),
            limit=3,
        )
        rows = session.execute(query).all()
    found: dict[str, set[str]] = {busy.name: set(), quiet.name: set()}
    for row in rows:
        found[row.name].add(row.id)
        assert row.tenant_id == (busy.id if row.name == busy.name else quiet.id)
    assert found[busy.name] == {busy_ids[1], busy_ids[3], busy_ids[4]}  # priorities 5, 5, 3
    assert found[quiet.name] == set(quiet_ids)


@pytest.mark.backends("postgresql", "sqlite")
def test_a_lead_is_held_by_one_owner_until_it_runs_out_on_either_database(
    backend_env: dict[str, str],
) -> None:
    name = f"test-lead-{uuid.uuid4().hex[:8]}"
    try:
        with transaction() as session:
            assert lead.claim(session, name, "first", ttl_ms=60_000)
        with transaction() as session:
            assert not lead.claim(session, name, "second", ttl_ms=60_000)
            assert lead.claim(session, name, "first", ttl_ms=60_000)  # renewed by its holder
        with transaction() as session:
            assert lead.claim(session, name, "first", ttl_ms=-1)  # its lease runs out
        with transaction() as session:
            assert lead.claim(session, name, "second", ttl_ms=60_000)
            holder = lead.holder(session, name)
            assert holder is not None
            assert holder.owner == "second"
    finally:
        with transaction() as session:
            lead.release(session, name, "second")


def _waits_for(tenant_id: str, *, namespace: int) -> bool:
    """Whether another transaction must wait for the tenant's lock of ``namespace``: it gives
    up at once rather than wait (``lock_timeout``)."""
    with get_sessionmaker()() as other, other.begin():
        other.execute(text("SET LOCAL lock_timeout = '100ms'"))
        try:
            backends.hold_tenant_lock(other, tenant_id, namespace=namespace)
        except OperationalError:
            return True
        return False


def test_a_tenant_lock_is_held_till_the_transaction_ends_and_holds_back_only_that_tenant(
    make_tenant: Callable[..., TenantHandle],
) -> None:
    first, second = make_tenant(), make_tenant()
    with get_sessionmaker()() as session:
        with session.begin():
            backends.hold_tenant_lock(session, first.id, namespace=1)
            session.scalar(select(Task.id).limit(1))  # a statement later: still held
            assert _waits_for(first.id, namespace=1)
            assert not _waits_for(first.id, namespace=2)  # another kind of row
            assert not _waits_for(second.id, namespace=1)  # another tenant
        assert not _waits_for(first.id, namespace=1)  # committed: let go


def test_the_fleet_wide_lock_is_held_till_the_transaction_ends(
    service_env: dict[str, str],
) -> None:
    def waits() -> bool:
        with get_sessionmaker()() as other, other.begin():
            other.execute(text("SET LOCAL lock_timeout = '100ms'"))
            try:
                lead.lock_round(other)
            except OperationalError:
                return True
            return False

    with get_sessionmaker()() as session:
        with session.begin():
            lead.lock_round(session)
            assert waits()
        assert not waits()
