"""The fleet's live view (``shared.ops.fleet``, ``/v1/admin/fleet``): the processes that run
steps, the queues, the runnable task due the longest and the sweeper's last run.

Each test runs on PostgreSQL with Redis (the production view) and on SQLite with the
in-process queue (the embedded default, whose view lives in process memory)."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import update

from shared.constants import LAST_SWEEP_PREFIX, WORKER_PREFIX, WORKERS_PREFIX
from shared.ops import fleet
from shared.ops.fleet import WorkerRecord
from shared.queue import enqueue_step, get_celery, webhook_queue
from shared.settings import get_settings
from shared.store.db import transaction
from shared.store.leases import Lease
from shared.store.tables import Task
from shared.transport.local import LocalPresence
from shared.transport.redis import RedisPresence
from tests.conftest import REDIS_URL, TenantHandle, environment
from tests.helpers import admit, calculator_script, scripted_task
from workers import heartbeat, presence, step_pool, sweeper

pytestmark = pytest.mark.backends("postgresql", "sqlite")
INTERVAL_S = 0.2  # so a record lives 0.6 s
FLOWER = "https://flower.example.com"


@pytest.fixture
def fleet_env(backend_env: dict[str, str]) -> Iterator[str]:
    """A fleet of this test's own (its own queue name, so its own Redis keys and its own
    in-process view), short-lived records and a Flower link; returns the backend."""
    queue = f"ratchet-fleet-{uuid.uuid4().hex[:8]}"
    env = {
        "RATCHET_QUEUE_NAME": queue,
        "RATCHET_PRESENCE_INTERVAL_SECONDS": str(INTERVAL_S),
        "RATCHET_SWEEP_GRACE_SECONDS": "1",
        "RATCHET_FLOWER_URL": FLOWER,
    }
    with environment(env):
        embedded = get_settings().embedded
        yield "sqlite" if embedded else "postgresql"
        if not embedded:
            keys = [queue, webhook_queue(get_settings())]
            keys += [WORKERS_PREFIX + queue, LAST_SWEEP_PREFIX + queue]
            broker = redis.Redis.from_url(REDIS_URL)
            broker.delete(*keys, *broker.scan_iter(match=f"{WORKER_PREFIX}{queue}:*"))


def a_record(**changes: object) -> WorkerRecord:
    now = time.time()
    record = WorkerRecord(
        name=f"w-{uuid.uuid4().hex[:6]}@host-a",
        host="host-a",
        pid=4242,
        worker_pid=4240,
        pool="prefork",
        concurrency=2,
        threads=256,
        busy=2,
        running=("task-1", "task-2"),
        started_at=now - 60,
        last_seen=now,
    )
    return replace(record, **changes)


def submit(client: TestClient, tenant: TenantHandle) -> str:
    body = scripted_task(calculator_script(2))
    response = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


# --- the workers -----------------------------------------------------------------------------


def test_a_published_worker_is_listed_until_its_record_expires(fleet_env: str) -> None:
    record = a_record()
    other = replace(record, pid=4343, busy=0, running=())
    ttl = fleet.TTL_INTERVALS * INTERVAL_S

    fleet.publish(record)
    fleet.publish(other)

    assert fleet.live_workers() == [record, other]  # by name, host and pid
    time.sleep(ttl / 2)
    fleet.publish(replace(other, last_seen=time.time()))  # still alive: published again
    time.sleep(ttl / 2 + 0.15)
    assert [w.pid for w in fleet.live_workers()] == [other.pid]  # the silent one is gone


def test_a_process_publishes_what_it_runs_and_leaves_when_it_stops(fleet_env: str) -> None:
    task_id = str(uuid.uuid4())
    lease = Lease(task_id=task_id, epoch=1, owner="test", step=1, attempt=1, ttl_ms=60_000)
    started, release = threading.Event(), threading.Event()

    def step() -> None:
        with heartbeat.kept(lease):
            started.set()
            release.wait(10)

    step_pool.get_pool().run(step)
    try:
        assert started.wait(5)
        presence.start()
        mine = wait_for(lambda: [w for w in fleet.live_workers() if w.pid == os.getpid()])
        [me] = mine
        assert me.name == presence.process_name().rsplit("/", 1)[0]
        assert (me.busy, me.running, me.threads) == (1, (task_id,), get_settings().worker_threads)
        assert me.started_at <= me.last_seen <= time.time()
    finally:
        release.set()
        presence.stop()
    assert [w for w in fleet.live_workers() if w.pid == os.getpid()] == []


def wait_for(found: Callable[[], list[WorkerRecord]], timeout: float = 5) -> list[WorkerRecord]:
    deadline = time.monotonic() + timeout
    while not (result := found()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return result


# --- the sweeper -----------------------------------------------------------------------------


def test_the_sweeper_records_each_run_it_makes(
    fleet_env: str, client: TestClient, tenant: TenantHandle
) -> None:
    assert fleet.last_sweep() is None
    lost = submit(client, tenant)
    assert admit() == 1
    with transaction() as session:  # due a minute ago: its message went missing long since
        session.execute(update(Task).where(Task.id == lost).values(due_ms=Task.due_ms - 60_000))

    before = time.time()
    sent = sweeper.sweep_once()

    sweep = fleet.last_sweep()
    assert sweep is not None
    assert sent >= 1
    assert (sweep.tasks_resent, sweep.deliveries_resent) == (sent, 0)
    assert sweep.process == presence.process_name()
    assert before <= sweep.at <= time.time()


# --- the queues and the backlog --------------------------------------------------------------


def test_queue_depth_counts_the_waiting_messages(fleet_env: str) -> None:
    for _ in range(3):
        enqueue_step(str(uuid.uuid4()), 1)

    steps, webhooks = fleet.queues()

    assert (steps.name, steps.kind, steps.depth) == (get_settings().queue_name, "steps", 3)
    assert (webhooks.kind, webhooks.depth, webhooks.oldest_age_ms) == ("webhooks", 0, None)
    if fleet_env == "postgresql":  # Redis can be looked into; the in-process queue cannot
        assert steps.oldest_age_ms is not None
        assert 0 <= steps.oldest_age_ms < 60_000
    else:
        assert steps.oldest_age_ms is None


def test_the_oldest_runnable_task_is_the_unleased_one_due_longest(
    fleet_env: str, client: TestClient, tenant: TenantHandle
) -> None:
    oldest, leased = submit(client, tenant), submit(client, tenant)
    with transaction() as session:
        session.execute(update(Task).where(Task.id == oldest).values(due_ms=2_000))
        far = int(time.time() * 1000) + 600_000
        session.execute(  # due even earlier, but a worker holds it
            update(Task)
            .where(Task.id == leased)
            .values(status="running", due_ms=1_000, lease_expires_ms=far)
        )

    with transaction() as session:
        found = fleet.oldest_runnable_task(session)

    assert found is not None
    assert (found.id, found.status, found.due_at.timestamp()) == (oldest, "queued", 2.0)
    assert found.overdue_ms > time.time() * 1000 - 60_000


# --- the endpoint ----------------------------------------------------------------------------


def test_the_fleet_view_is_for_operators(
    fleet_env: str, client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    admin, operator = make_tenant(("admin",)), make_tenant(("operator",))
    record = a_record()
    fleet.publish(record)
    fleet.record_sweep(process="w1@host-a/4240", tasks_resent=2, deliveries_resent=1)

    refused = client.get("/v1/admin/fleet", headers=admin.headers)
    answer = client.get("/v1/admin/fleet", headers=operator.headers)

    assert refused.status_code == 403, refused.text
    assert refused.headers["content-type"].startswith("application/problem+json")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) == {"workers", "queues", "oldest_runnable_task", "sweeper", "flower_url"}
    [worker] = [w for w in body["workers"] if w["name"] == record.name]
    assert worker | {"started_at": None, "last_seen": None} == {
        "name": record.name,
        "host": "host-a",
        "pid": 4242,
        "worker_pid": 4240,
        "pool": "prefork",
        "concurrency": 2,
        "threads": 256,
        "busy": 2,
        "running": ["task-1", "task-2"],
        "started_at": None,
        "last_seen": None,
    }
    assert worker["last_seen"].endswith(("Z", "+00:00"))
    assert [q["kind"] for q in body["queues"]] == ["steps", "webhooks"]
    assert body["sweeper"] | {"at": None} == {
        "process": "w1@host-a/4240",
        "at": None,
        "tasks_resent": 2,
        "deliveries_resent": 1,
    }
    assert body["flower_url"] == FLOWER


@pytest.mark.backends("postgresql")
def test_the_fleet_view_is_a_503_while_redis_is_down(
    fleet_env: str, client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    operator = make_tenant(("operator",))
    with environment({"RATCHET_REDIS_URL": "redis://127.0.0.1:1/0"}):
        answer = client.get("/v1/admin/fleet", headers=operator.headers)

    assert answer.status_code == 503, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert int(answer.headers["retry-after"]) > 0


# --- the parts ---------------------------------------------------------------------------------


@pytest.mark.backends("postgresql")  # only Redis keeps records another version may write
def test_a_record_of_another_version_is_left_out(fleet_env: str) -> None:
    view = fleet.get_fleet().presence
    assert isinstance(view, RedisPresence)
    good, bad = a_record(), a_record(pid=1)
    fleet.publish(good)
    fleet.publish(bad)
    view.client.set(view.prefix + bad.member, '{"name": "w", "shape": "new"}')

    assert fleet.live_workers() == [good]


def test_the_embedded_default_keeps_the_view_in_this_process(fleet_env: str) -> None:
    view = fleet.get_fleet().presence
    assert isinstance(view, LocalPresence if fleet_env == "sqlite" else RedisPresence)
    assert get_celery().conf.broker_url.startswith("memory://") == (fleet_env == "sqlite")


@pytest.mark.parametrize(
    ("pool", "name"),
    [
        ("threads", "threads"),
        ("celery.concurrency.prefork:TaskPool", "prefork"),
        ("celery.concurrency.solo:TaskPool", "solo"),
    ],
)
def test_a_pool_is_named_as_celery_names_it(pool: str, name: str) -> None:
    from kombu.utils.imports import symbol_by_name

    given = symbol_by_name(pool) if ":" in pool else pool
    assert presence.pool_name(given) == name
