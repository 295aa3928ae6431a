"""The direct path on both backends: a task submitted while nothing waits ahead of it is
admitted by its own INSERT, with its message sent by the API, and only then; whatever waits
in the backlog, or a task under a limit, goes through the dispatcher's rounds."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shared.ops.fleet import get_fleet
from shared.queue import get_celery
from shared.scheduling import admission, concurrency, gate
from shared.settings import get_settings
from shared.store.db import transaction
from shared.store.tables import Task
from tests.conftest import TenantHandle
from tests.integration.test_scheduling import settings, submit
from workers.dispatcher import Dispatcher

pytestmark = pytest.mark.backends("postgresql", "sqlite")


def queued() -> int:
    """Messages waiting in the broker's queue."""
    depth = get_fleet().depth(get_settings().queue_name)
    assert depth is not None
    return depth


def purge() -> None:
    with get_celery().connection_for_write() as connection:
        connection.default_channel.queue_purge(get_settings().queue_name)


@contextmanager
def leading(**values: Any) -> Iterator[Dispatcher]:
    """A dispatcher that leads, on a queue of its own (empty), with these settings (direct
    admission on, unless they say otherwise)."""
    values = {"direct_admission": "true", **values}
    with settings(queue_name=f"ratchet-test-direct-{time.time_ns()}", **values):
        dispatcher = Dispatcher()
        assert dispatcher.lead()
        try:
            while dispatcher.round().admitted:
                pass  # what earlier tests left waiting, if anything: out of the way
            purge()
            yield dispatcher
        finally:
            dispatcher.resign()
            purge()


def admitted_at_insert(task_id: str) -> bool:
    with transaction() as session:
        task = session.get(Task, task_id)
        assert task is not None
        return task.admitted_ms is not None


def test_a_task_submitted_while_nothing_waits_is_admitted_without_a_round(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    with leading() as dispatcher:
        assert dispatcher.round().spare  # nothing waits: the dispatcher opens the gate
        task = submit(client, tenant)
        assert admitted_at_insert(task)
        assert queued() == 1  # its message, sent by the API
        assert dispatcher.round().admitted == []  # never admitted a second time
        assert queued() == 1
        assert drive(task) == "succeeded"


def test_a_task_under_a_limit_or_not_yet_due_waits_for_a_round(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    limited, other = make_tenant(), make_tenant()
    with leading(concurrency={"tenants": {limited.name: {"max_running": 5}}}) as dispatcher:
        assert dispatcher.round().spare
        held = submit(client, limited)  # the API counts no slots: the dispatcher does
        later = submit(client, other, delay_seconds=3600)
        assert not admitted_at_insert(held)
        assert not admitted_at_insert(later)
        assert queued() == 0
        assert [task for task, _ in dispatcher.round().admitted] == [held]


def test_a_task_held_back_by_its_own_limit_leaves_the_gate_open(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    limited, other = make_tenant(), make_tenant()
    with leading(concurrency={"tenants": {limited.name: {"max_running": 1}}}) as dispatcher:
        for _ in range(2):
            submit(client, limited)
        found = dispatcher.round()
        assert len(found.admitted) == 1
        assert found.waiting  # the other waits for its slot
        assert found.spare  # which no other tenant's task would take from it
        assert admitted_at_insert(submit(client, other))


def test_work_left_waiting_for_room_closes_the_gate_so_nothing_overtakes_it(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    first, second = make_tenant(), make_tenant()
    with leading() as dispatcher:
        with transaction() as session:
            used = admission.in_use(session, concurrency.cached(session)).total
        # One slot left in the fleet (beside what earlier tests hold, if anything).
        dispatcher.settings = dispatcher.settings.model_copy(update={"dispatch_capacity": used + 1})
        assert dispatcher.round().spare
        assert admitted_at_insert(submit(client, first))  # the fleet's one slot
        waiting = submit(client, first)  # the gate has no slot left for it
        assert not admitted_at_insert(waiting)
        found = dispatcher.round()
        assert found.admitted == []
        assert found.waiting
        assert not found.spare
        late = submit(client, second)
        assert not admitted_at_insert(late)  # behind the waiting task, in the backlog


def test_the_gate_lets_in_as_many_as_the_round_left_room_for(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    # No default share: the window alone bounds the gate.
    with leading(dispatch_window=3, tenant_default_share="1") as dispatcher:
        spare = dispatcher.round().spare
        assert 1 <= spare <= 3  # the window's room
        direct = [submit(client, tenant) for _ in range(spare)]
        assert all(admitted_at_insert(task) for task in direct)
        assert queued() == spare
        late = submit(client, tenant)  # no slot left: the backlog, till a round has room
        assert not admitted_at_insert(late)
        assert dispatcher.round().admitted == []  # the window is full of the direct ones
        for task in direct:
            assert drive(task) == "succeeded"
        assert dispatcher.round().admitted == [(late, 1)]


def test_slots_taken_before_their_tasks_commit_are_not_offered_again(
    client: TestClient, tenant: TenantHandle
) -> None:
    """A submission takes its slot before its INSERT commits: a round in between sees the slot
    free, and must offer it to nobody else (a flood could then take the fleet)."""
    # No default share: the window alone bounds the gate.
    with leading(dispatch_window=3, tenant_default_share="1") as dispatcher:
        spare = dispatcher.round().spare
        assert spare >= 1
        for _ in range(spare):  # taken, as submissions take them; no INSERT has committed
            assert gate.take_slot()
        waiting = submit(client, tenant)  # the gate has no slot left: to the backlog
        # The database shows the same room as before, but what is in flight is held back:
        # the round admits nothing, and the gate stays closed.
        found = dispatcher.round()
        assert found.admitted == []
        assert not found.spare
        assert not gate.take_slot()
        for _ in range(spare):  # they land (here: their submissions failed)
            gate.land_slot()
        assert [task for task, _ in dispatcher.round().admitted] == [waiting]


def test_a_direct_task_or_turn_lands_its_slot_once_committed(
    client: TestClient, tenant: TenantHandle
) -> None:
    with leading() as dispatcher:
        assert dispatcher.round().spare
        assert admitted_at_insert(submit(client, tenant))
        assert dispatcher.gate.close() == 0  # nothing in flight: it landed
        assert dispatcher.round().spare
        thread = client.post("/v1/threads", json={}, headers=tenant.headers).json()
        script = {"script": [{"content": "Hello."}]}
        body = {"input": "Hi.", "model": "scripted", "model_options": script}
        turn = client.post(f"/v1/threads/{thread['id']}/runs", json=body, headers=tenant.headers)
        assert turn.status_code == 202, turn.text
        assert admitted_at_insert(turn.json()["id"])
        assert dispatcher.gate.close() == 0


def test_without_a_leader_or_when_turned_off_every_task_goes_through_the_backlog(
    client: TestClient, tenant: TenantHandle
) -> None:
    with leading() as dispatcher:
        assert dispatcher.round().spare
        dispatcher.resign()  # its lead given up: it closes the gate
        assert not admitted_at_insert(submit(client, tenant))
    with leading(direct_admission="false") as dispatcher:
        assert dispatcher.round().spare
        assert not admitted_at_insert(submit(client, tenant))


@pytest.mark.backends("postgresql")
def test_a_direct_task_whose_message_never_went_is_sent_by_the_sweeper(
    client: TestClient, tenant: TenantHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API committed the task admitted, then died (or lost the broker) before sending its
    message: the sweeper sends it, as for any admitted task without one."""
    from shared.actions import effects
    from workers import sweeper

    with leading(sweep_grace_seconds="1") as dispatcher:
        assert dispatcher.round().spare
        with monkeypatch.context() as lost:  # the API's message only: the sweeper's goes
            lost.setattr(effects, "enqueue_steps", lambda steps: False)
            task = submit(client, tenant)
        assert admitted_at_insert(task)
        assert queued() == 0
        time.sleep(1.3)  # past the grace
        assert sweeper.sweep_once() == 1
        assert queued() == 1
        assert sweeper.sweep_once() == 0  # one message, not one a sweep
