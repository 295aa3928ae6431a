"""Fair scheduling on both backends: the dispatcher's admission (round-robin across tenants,
concurrency limits per tenant, agent and pool, priority, run_at), queue caps, the operator's
runtime limits, and schedules firing once per tick."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import Connection, func, select, text, update
from sqlalchemy.orm import Session

from shared.scheduling import admission, concurrency
from shared.store.db import get_engine, transaction
from shared.store.tables import Schedule, Task
from tests.conftest import REDIS_URL, TenantHandle, environment
from tests.helpers import admit, scripted_task
from workers.steps.runner import advance

ANSWER = [{"content": "done"}]


@contextmanager
def settings(**values: Any) -> Iterator[None]:
    env = {
        f"RATCHET_{k.upper()}": v if isinstance(v, str) else json.dumps(v)
        for k, v in values.items()
    }
    with environment(env):
        concurrency._configured.cache_clear()
        concurrency.forget_cache()
        try:
            yield
        finally:
            concurrency._configured.cache_clear()
            concurrency.forget_cache()


def submit(client: TestClient, tenant: TenantHandle, **extra: Any) -> str:
    response = client.post("/v1/tasks", json=scripted_task(ANSWER, **extra), headers=tenant.headers)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def admitted(tenant: TenantHandle) -> set[str]:
    """The tenant's tasks that hold slots now: admitted and not ended."""
    with transaction() as session:
        return set(
            session.scalars(
                select(Task.id).where(
                    Task.tenant_id == tenant.id,
                    Task.admitted_ms.is_not(None),
                    Task.status.in_(("queued", "running")),
                )
            )
        )


def test_admission_takes_tenants_in_turn_so_a_small_tenant_is_not_stuck_behind_a_big_one(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    big, small = make_tenant(), make_tenant()
    for _ in range(20):
        submit(client, big)
    late = {submit(client, small) for _ in range(3)}
    with settings(dispatch_window=6):
        assert admit() == 6  # the window: six messages in the broker, no more
        assert admitted(small) == late  # every one of them, ahead of the big tenant's backlog
        assert len(admitted(big)) == 3


def test_without_fair_scheduling_admission_is_one_fifo(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    big, small = make_tenant(), make_tenant()
    first = [submit(client, big) for _ in range(6)]
    for _ in range(3):
        submit(client, small)
    with settings(dispatch_window=6, fair_scheduling="false"):
        assert admit() == 6
        assert admitted(big) == set(first)
        assert admitted(small) == set()


def test_a_tenant_limit_holds_its_running_steps_while_others_run(
    client: TestClient, make_tenant: Callable[..., TenantHandle], drive: Callable[..., str]
) -> None:
    limited, other = make_tenant(), make_tenant()
    ids = [submit(client, limited) for _ in range(5)]
    others = {submit(client, other) for _ in range(3)}
    with settings(concurrency={"tenants": {limited.name: {"max_running": 2}}}):
        assert admit() == 5
        running = admitted(limited)
        assert len(running) == 2
        assert admitted(other) == others  # the other slots serve the other tenant
        assert admit() == 0
        assert drive(sorted(running)[0]) == "succeeded"  # a slot frees up: one more goes
        assert admit() == 1
        assert len(admitted(limited) - running) == 1
        assert len(set(ids) - admitted(limited)) == 3  # one ended, two wait


def test_an_agent_limit_and_a_pool_limit_hold_across_tenants(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    a, b = make_tenant(), make_tenant()
    for _ in range(3):
        submit(client, a)
        submit(client, b)
    pool = {"pools": {"scripted": {"models": ["scripted"], "max_running": 3}}}
    with settings(concurrency=pool):
        assert admit() == 3
        assert {len(admitted(a)), len(admitted(b))} == {1, 2}  # in turn, within the pool
    for _ in range(2):
        submit(client, a)
    with settings(concurrency={"agents": {"default": {"max_running": 4}}}):
        assert admit() == 1  # four of the default agent's tasks are admitted now


def test_priority_orders_a_tenants_own_tasks(
    client: TestClient, tenant: TenantHandle, make_tenant: Callable[..., TenantHandle]
) -> None:
    for _ in range(3):
        submit(client, tenant)
    urgent = submit(client, tenant, priority=5)
    with settings(dispatch_window=1):
        assert admit() == 1
        assert admitted(tenant) == {urgent}


def test_run_at_and_delay_seconds_keep_a_task_back_until_then(
    client: TestClient, tenant: TenantHandle
) -> None:
    later = submit(client, tenant, delay_seconds=3600)
    at = "2020-01-01T00:00:00+00:00"  # in the past: at once
    now = submit(client, tenant, run_at=at)
    assert admit() == 1
    assert admitted(tenant) == {now}
    task = client.get(f"/v1/tasks/{later}", headers=tenant.headers).json()
    assert task["status"] == "queued"
    assert task["run_at"] is not None
    assert task["priority"] == 0

    for body, field in (
        ({"run_at": at, "delay_seconds": 1}, "delay_seconds"),
        ({"run_at": "2030-01-01T00:00:00"}, "run_at"),  # no UTC offset
        ({"run_at": "2099-01-01T00:00:00Z"}, "run_at"),  # past a year ahead
        ({"priority": 11}, "priority"),
    ):
        response = client.post(
            "/v1/tasks", json=scripted_task(ANSWER, **body), headers=tenant.headers
        )
        assert response.status_code == 422, response.text
        assert response.headers["content-type"] == "application/problem+json"
        assert field in response.json()["errors"][0]["field"]


def test_past_its_queue_cap_a_submission_is_refused_and_creates_nothing(
    client: TestClient, tenant: TenantHandle
) -> None:
    with settings(concurrency={"tenants": {tenant.name: {"max_queued": 2}}}):
        submit(client, tenant)
        submit(client, tenant)
        response = client.post("/v1/tasks", json=scripted_task(ANSWER), headers=tenant.headers)
        assert response.status_code == 429
        assert response.headers["content-type"] == "application/problem+json"
        assert int(response.headers["Retry-After"]) >= 1
        assert "max_queued 2" in response.json()["detail"]
    with transaction() as session:
        count = session.scalar(
            select(func.count()).select_from(Task).where(Task.tenant_id == tenant.id)
        )
    assert count == 2


def test_a_step_waiting_for_a_rate_limit_gives_its_slot_back(
    client: TestClient, tenant: TenantHandle
) -> None:
    rate = {"models": {"scripted": {"requests": 1, "per_seconds": 60}}}
    with settings(rate_limits=rate, rate_limit_inline_wait_ms="0"):
        first, second = submit(client, tenant), submit(client, tenant)
        assert admit() == 2
        advance(first, 1)
        advance(second, 1)  # no token for a minute: it waits in the backlog, holding nothing
        with transaction() as session:
            row = session.get(Task, second)
            assert row is not None
            assert (row.status, row.admitted_ms) == ("running", None)
            assert row.due_ms is not None
        assert admitted(tenant) == set()
        assert admit() == 0  # not due yet


def test_the_dispatcher_waits_while_the_broker_holds_half_its_window(
    client: TestClient, tenant: TenantHandle
) -> None:
    """Rounds are fewer and larger: none while workers have half a window still to take."""
    from workers.dispatcher import Dispatcher

    for _ in range(3):
        submit(client, tenant)
    queue = f"ratchet-test-halfwindow-{time.time_ns()}"
    # One tenant fills the window here: no default share of the fleet holds it back.
    with settings(dispatch_window=4, queue_name=queue, tenant_default_share="1"):
        dispatcher = Dispatcher()
        try:
            assert not dispatcher.broker_full()
            assert admit() == 3  # the window has room for 4; the broker then holds 3
            assert dispatcher.broker_full()
            redis.Redis.from_url(REDIS_URL).delete(dispatcher.settings.queue_name)
            assert not dispatcher.broker_full()
        finally:
            redis.Redis.from_url(REDIS_URL).delete(dispatcher.settings.queue_name)


def index_scans(conn: Connection) -> Counter[str]:
    """Scans of each of the tasks table's indexes so far (this connection's own included)."""
    conn.execute(text("SELECT pg_stat_clear_snapshot()"))
    rows = conn.execute(
        text("SELECT indexrelname, idx_scan FROM pg_stat_user_indexes WHERE relname = 'tasks'")
    )
    return Counter({name: int(scans) for name, scans in rows})


def test_the_backlogs_reads_use_its_partial_indexes_under_generic_plans(
    client: TestClient, tenant: TenantHandle
) -> None:
    """Sessions plan generically; with the statuses bound, not written in the SQL, a generic
    plan cannot use the partial indexes, and each round would read every runnable task.

    The tenant's backlog is long and the table analysed first: with a handful of rows, and
    statistics from whatever ran before, the planner may as well pick the tenant's other
    index for a backlog it reads whole either way (it did, on a busy machine)."""
    task_id = submit(client, tenant)
    with get_engine().begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tasks SELECT (jsonb_populate_record(t, jsonb_build_object('id', "
                "gen_random_uuid()::text, 'due_ms', t.due_ms - n))).* "
                "FROM tasks t, generate_series(1, 2000) n WHERE t.id = :id"
            ),
            {"id": task_id},
        )
        conn.execute(text("ANALYZE tasks"))
    with get_engine().connect() as conn:
        session = Session(bind=conn)
        before = index_scans(conn)
        conn.commit()
        for _ in range(8):  # past the driver's prepare threshold: a prepared, generic plan
            admission.in_use(session, concurrency.cached(session))
            admission.candidates(session, per_tenant=8, fair=True)
            conn.commit()
        conn.execute(text("SELECT pg_stat_force_next_flush()"))
        conn.commit()
        used = index_scans(conn) - before
        conn.commit()
    assert used["ix_tasks_admitted"] >= 8, used
    assert used["ix_tasks_backlog"] >= 8, used
    assert used["ix_tasks_status_due"] == 0, used


def test_an_operator_sets_limits_at_runtime_and_sees_their_use(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    operator, admin = make_tenant(("operator",)), make_tenant(("admin",))
    url = f"/v1/admin/concurrency/tenants/{admin.name}"
    assert client.put(url, json={"max_running": 1}, headers=admin.headers).status_code == 403
    bad = client.put(url, json={"max_running": 0}, headers=operator.headers)
    assert bad.status_code == 422
    assert bad.json()["errors"][0]["field"] == "max_running"
    response = client.put(url, json={"max_running": 1}, headers=operator.headers)
    assert response.status_code == 200, response.text
    assert response.json()["source"] == "runtime"
    assert response.json()["updated_by"].startswith("key:")

    for _ in range(3):
        submit(client, admin)
    assert admit() == 1  # the runtime limit applies at once
    view = client.get("/v1/admin/concurrency", headers=operator.headers).json()
    (limit,) = [x for x in view["limits"] if x["name"] == admin.name]
    assert limit["spec"]["max_running"] == 1
    assert view["tenants"][admin.name] == {"running": 1, "waiting": 2, "queued": 2}
    assert client.get("/v1/admin/concurrency", headers=admin.headers).status_code == 403

    assert client.delete(url, headers=operator.headers).status_code == 204
    assert client.delete(url, headers=operator.headers).status_code == 404
    assert admit() == 2


def schedule_body(**extra: Any) -> dict[str, Any]:
    return (
        {"name": "nightly", "cron": "0 3 * * *", "timezone": "Europe/Paris"}
        | {"task": scripted_task(ANSWER)}
        | extra
    )


def move_tick(schedule_id: str, tick_ms: int) -> None:
    with transaction() as session:
        session.execute(
            update(Schedule).where(Schedule.id == schedule_id).values(next_fire_ms=tick_ms)
        )


def tasks_of(schedule_id: str) -> list[Task]:
    with transaction() as session:
        return list(session.scalars(select(Task).where(Task.schedule_id == schedule_id)))


def test_a_schedule_fires_once_per_tick(
    client: TestClient, tenant: TenantHandle, make_tenant: Callable[..., TenantHandle]
) -> None:
    response = client.post("/v1/schedules", json=schedule_body(), headers=tenant.headers)
    assert response.status_code == 201, response.text
    schedule = response.json()
    assert schedule["next_fire_at"] is not None
    assert (
        client.post("/v1/schedules", json=schedule_body(), headers=tenant.headers).status_code
        == 409
    )

    tick = int(time.time() * 1000) - 1000
    move_tick(schedule["id"], tick)
    admit()
    (task,) = tasks_of(schedule["id"])
    assert task.idempotency_key == f"schedule:{schedule['id']}:{tick}"
    move_tick(schedule["id"], tick)  # as if a second dispatcher read the same tick
    admit()
    assert len(tasks_of(schedule["id"])) == 1  # never twice for a tick
    after = client.get(f"/v1/schedules/{schedule['id']}", headers=tenant.headers).json()
    assert after["fired"] == 1
    assert after["last_task_id"] == task.id

    other = make_tenant()
    assert client.get(f"/v1/schedules/{schedule['id']}", headers=other.headers).status_code == 404
    assert client.get("/v1/schedules", headers=other.headers).json()["items"] == []


@pytest.mark.parametrize(("catch_up", "runs"), [("run_once", 1), ("skip", 0)])
def test_ticks_missed_while_the_fleet_was_down_run_once_or_are_skipped(
    client: TestClient, tenant: TenantHandle, catch_up: str, runs: int
) -> None:
    body = schedule_body(cron="* * * * *", catch_up=catch_up)
    schedule = client.post("/v1/schedules", json=body, headers=tenant.headers).json()
    move_tick(schedule["id"], int(time.time() * 1000) - 10 * 60_000)  # ten ticks ago
    admit()
    assert len(tasks_of(schedule["id"])) == runs
    after = client.get(f"/v1/schedules/{schedule['id']}", headers=tenant.headers).json()
    assert (after["fired"], after["skipped"]) == (runs, 1 - runs)
    assert after["next_fire_at"] > time.strftime("%Y-%m-%dT%H:%M", time.gmtime())


def test_a_paused_schedule_does_not_fire_and_bad_ones_are_refused(
    client: TestClient, tenant: TenantHandle
) -> None:
    schedule = client.post("/v1/schedules", json=schedule_body(), headers=tenant.headers).json()
    url = f"/v1/schedules/{schedule['id']}"
    assert client.post(f"{url}/pause", headers=tenant.headers).json()["paused"] is True
    move_tick(schedule["id"], int(time.time() * 1000) - 1000)
    admit()
    assert tasks_of(schedule["id"]) == []
    resumed = client.post(f"{url}/resume", headers=tenant.headers).json()
    assert resumed["paused"] is False
    assert resumed["next_fire_at"] is not None
    assert client.delete(url, headers=tenant.headers).status_code == 204
    assert client.get(url, headers=tenant.headers).status_code == 404

    for extra, field in (
        ({"cron": "every day at 3"}, "cron"),
        ({"timezone": "Mars/Olympus"}, "timezone"),
        ({"name": "two", "task": scripted_task(ANSWER, delay_seconds=5)}, "task.delay_seconds"),
    ):
        response = client.post("/v1/schedules", json=schedule_body(**extra), headers=tenant.headers)
        assert response.status_code == 422, response.text
        assert response.json()["errors"][0]["field"] == field


def test_the_dashboard_shows_an_operator_the_limits_and_their_use(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    from tests.integration.test_dashboard import login

    operator, busy = make_tenant(("operator",)), make_tenant()
    for _ in range(2):
        submit(client, busy)
    with settings(concurrency={"tenants": {busy.name: {"max_running": 1}}}):
        assert admit() == 1
        login(client, operator.key)
        page = client.get("/dashboard/ratelimits")
    assert page.status_code == 200
    assert "Concurrency limits" in page.text
    assert busy.name in page.text
    assert "1 / 1" in page.text  # its one slot, in use
