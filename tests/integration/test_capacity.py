"""DESIGN §5, "waiting holds nothing scarce": what a step holds while its model or a tool
works, and what its lease's heartbeat costs however many steps a process has in flight."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, select

from shared.store import checkpoints, leases
from shared.store.backends import write_session
from shared.store.db import get_engine, transaction
from shared.store.tables import Task
from tests.conftest import TenantHandle
from tests.helpers import calculator_script, scripted_task
from tests.integration.test_durability import submit, task_row
from workers import heartbeat, tool_runner
from workers.providers.scripted import ScriptedProvider
from workers.steps import runner


class HeldConnections:
    """The database connections each thread of this process has checked out right now."""

    def __init__(self) -> None:
        self._held: Counter[int] = Counter()
        self._lock = threading.Lock()

    def checkout(self, *_: Any) -> None:
        with self._lock:
            self._held[threading.get_ident()] += 1

    def checkin(self, *_: Any) -> None:
        with self._lock:
            self._held[threading.get_ident()] -= 1

    def by_this_thread(self) -> int:
        with self._lock:
            return self._held[threading.get_ident()]


@pytest.fixture
def held(service_env: dict[str, str]) -> Iterator[HeldConnections]:
    pool = get_engine().pool
    counter = HeldConnections()
    event.listen(pool, "checkout", counter.checkout)
    event.listen(pool, "checkin", counter.checkin)
    yield counter
    event.remove(pool, "checkout", counter.checkout)
    event.remove(pool, "checkin", counter.checkin)


def test_a_step_holds_no_database_connection_while_its_model_or_tool_works(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    held: HeldConnections,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, list[int]] = {"model": [], "tool": []}
    complete, execute = ScriptedProvider.complete, tool_runner.execute

    def model_call(self: ScriptedProvider, request: Any) -> Any:
        seen["model"].append(held.by_this_thread())
        return complete(self, request)

    def tool_call(*args: Any, **kwargs: Any) -> Any:
        seen["tool"].append(held.by_this_thread())
        return execute(*args, **kwargs)

    monkeypatch.setattr(ScriptedProvider, "complete", model_call)
    monkeypatch.setattr(tool_runner, "execute", tool_call)
    task_id = submit(client, tenant, scripted_task(calculator_script(3), tools=["calculator"]))

    assert drive(task_id) == "succeeded"
    # Three model calls and two tool calls, each made with no connection checked out.
    assert seen == {"model": [0, 0, 0], "tool": [0, 0]}
    assert held.by_this_thread() == 0


def take_leases(task_ids: list[str], *, ttl_ms: int = 30_000) -> list[leases.Lease]:
    taken = []
    with write_session() as session:
        for task_id in task_ids:
            lease = leases.take_lease(
                session, task_id, owner="test", ttl_ms=ttl_ms, step=1, max_attempts=5
            )
            assert isinstance(lease, leases.Lease), lease
            taken.append(lease)
    return taken


def expiries(task_ids: list[str]) -> dict[str, int]:
    with transaction() as session:
        rows = session.execute(
            select(Task.id, Task.lease_expires_ms).where(Task.id.in_(task_ids))
        ).all()
    return {row.id: row.lease_expires_ms for row in rows}


def test_the_heartbeat_extends_every_lease_of_a_process_in_one_statement(
    client: TestClient, tenant: TenantHandle
) -> None:
    ids = [submit(client, tenant, scripted_task(calculator_script(2))) for _ in range(40)]
    held = [replace(lease, ttl_ms=60_000) for lease in take_leases(ids, ttl_ms=1_000)]
    before = expiries(ids)
    statements: list[str] = []

    def count(_conn: Any, _cursor: Any, sql: str, *_: Any) -> None:
        statements.append(sql)

    engine = get_engine(heartbeat=True)  # a connection of its own, never queued behind steps
    event.listen(engine, "before_cursor_execute", count)
    try:
        heartbeat.extend(held)
    finally:
        event.remove(engine, "before_cursor_execute", count)

    assert len(statements) == 1, statements
    after = expiries(ids)
    # Taken for 1 s, each lease now runs a minute from the heartbeat: 59 s more at least.
    assert all(after[i] >= before[i] + 59_000 for i in ids), (before, after)


def test_the_heartbeat_drops_a_lease_that_was_lost_and_keeps_the_rest(
    client: TestClient, tenant: TenantHandle
) -> None:
    ids = [submit(client, tenant, scripted_task(calculator_script(2))) for _ in range(3)]
    old = take_leases(ids)
    with transaction() as session:  # the first task's lease ran out …
        session.get(Task, ids[0]).lease_expires_ms = 0  # type: ignore[union-attr]
    (newer,) = take_leases(ids[:1])  # … and another worker took it: a new epoch

    with write_session() as session:
        extended = leases.extend_leases(session, [*old, newer], ttl_ms=60_000)

    held = {(newer.task_id, newer.epoch), *((x.task_id, x.epoch) for x in old[1:])}
    assert extended == dict.fromkeys(held, False)  # and no cancel was requested


def test_a_step_with_a_slow_model_leaves_the_database_pool_to_the_others(
    client: TestClient, tenant: TenantHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many steps waiting on their models at once, in threads as a worker process runs them,
    hold no connection among them: the pool is free for the one step that writes."""
    waiting, release = threading.Barrier(9), threading.Event()
    complete = ScriptedProvider.complete
    checked_out: list[int] = []

    def slow(self: ScriptedProvider, request: Any) -> Any:
        if request.step == 1:
            waiting.wait(timeout=60)  # all eight steps are in their model call …
            release.wait(timeout=60)
        return complete(self, request)

    monkeypatch.setattr(ScriptedProvider, "complete", slow)
    ids = [submit(client, tenant, scripted_task(calculator_script(2))) for _ in range(8)]
    threads = [threading.Thread(target=runner.advance, args=(i, 1)) for i in ids]
    for thread in threads:
        thread.start()
    waiting.wait(timeout=60)
    checked_out.append(get_engine().pool.checkedout())  # type: ignore[attr-defined]
    release.set()
    for thread in threads:
        thread.join(timeout=60)

    assert checked_out == [0]  # … and none of them holds a connection
    with transaction() as session:
        steps = session.scalars(select(Task.steps).where(Task.id.in_(ids))).all()
    assert sorted(steps) == [1] * 8


def test_a_step_past_its_time_limit_is_no_longer_kept_alive(
    client: TestClient, tenant: TenantHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process's heartbeat thread may tick meanwhile: it must not extend them either.
    monkeypatch.setattr(heartbeat, "extend", lambda leases: None)
    stuck, running = take_leases(
        [submit(client, tenant, scripted_task(calculator_script(2))) for _ in range(2)]
    )
    with heartbeat.kept(stuck), heartbeat.kept(running):
        # Both were last extended a minute ago (their TTL is 30 s: due); the stuck step
        # started longer ago than the step time limit (900 s by default).
        for lease, started_ago in ((stuck, 901), (running, 60)):
            _, _, extended = heartbeat._leases[id(lease)]
            heartbeat._leases[id(lease)] = (lease, extended - started_ago, extended - 60)

        due = heartbeat._due()

        assert [lease.task_id for lease in due] == [running.task_id]
        assert not heartbeat.holding(stuck)  # let go: its step asks no model any more


def test_steps_that_go_on_in_place_read_nothing_and_see_the_same_chat(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A task run step after step on one thread carries its conversation over: a step leased
    by its predecessor's completion reads no rows at all, and the model is asked exactly what
    it is asked when every step rebuilds the conversation from the rows."""
    asked: dict[str, list[Any]] = {}
    read_from: list[str] = []
    leases_taken: list[str] = []
    complete, load_history = ScriptedProvider.complete, checkpoints.load_history
    take_lease = leases.take_lease

    def leasing(session: Any, task_id: str, **kwargs: Any) -> Any:
        leases_taken.append(task_id)
        return take_lease(session, task_id, **kwargs)

    def recording(self: ScriptedProvider, request: Any) -> Any:
        asked.setdefault(request.task_id, []).append(request.messages)
        return complete(self, request)

    def reading(session: Any, task_id: str) -> Any:
        read_from.append(task_id)
        return load_history(session, task_id)

    monkeypatch.setattr(ScriptedProvider, "complete", recording)
    monkeypatch.setattr(checkpoints, "load_history", reading)
    monkeypatch.setattr(leases, "take_lease", leasing)
    body = scripted_task(calculator_script(6), tools=["calculator"])
    rebuilt, carried = submit(client, tenant, body), submit(client, tenant, body)

    assert drive(rebuilt) == "succeeded"  # a message per step: each reads the whole history
    assert read_from == [rebuilt] * 5
    read_from.clear()
    runner.advance(carried, 1, go_on=lambda: True)  # one message, six steps in place

    done = task_row(carried)
    assert done.status == "succeeded"
    assert read_from == []  # each later step read nothing: its history was carried over
    # One lease taken; each later step was leased by its predecessor's completion, each
    # with an epoch of its own.
    assert leases_taken.count(carried) == 1
    assert leases_taken.count(rebuilt) == 6
    assert done.lease_epoch == task_row(rebuilt).lease_epoch == 6
    assert len(asked[carried]) == 6
    assert asked[carried] == asked[rebuilt]
