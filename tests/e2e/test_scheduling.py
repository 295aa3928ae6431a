"""Fair scheduling with real processes: a small tenant is not stuck behind a big one's backlog,
nor behind its flood of slow tasks (the default share of the fleet), concurrency limits hold
at the model server, a killed dispatcher loses and doubles nothing, and a schedule fires once
per tick through a kill -9."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from sqlalchemy import func, select

from shared.store.db import transaction
from shared.store.tables import Leader, Task, TaskEvent
from tests.conftest import TenantHandle
from tests.e2e.conftest import Stack, StackFactory
from tests.e2e.util import wait_all
from tests.fakes.openai_server import OpenAIServer, Received, Reply, answer
from tests.helpers import TERMINAL, scripted_task

ANSWER = [{"content": "done"}]


def submit_many(
    http: httpx.Client, tenant: TenantHandle, bodies: list[dict[str, Any]]
) -> list[str]:
    def one(body: dict[str, Any]) -> str:
        response = http.post("/v1/tasks", json=body, headers=tenant.headers)
        assert response.status_code == 202, response.text
        return str(response.json()["id"])

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, bodies))


def unfinished(tenant: TenantHandle) -> int:
    with transaction() as session:
        return int(
            session.scalar(
                select(func.count())
                .select_from(Task)
                .where(Task.tenant_id == tenant.id, Task.status.not_in(TERMINAL))
            )
            or 0
        )


def test_a_small_tenant_finishes_while_a_big_tenants_backlog_is_still_draining(
    stack: StackFactory, make_tenant: Callable[..., TenantHandle]
) -> None:
    # A small fleet (8 slots) and slow steps: the big tenant's 600 tasks take about 15 s.
    fleet = stack(workers=1, concurrency=2, env={"RATCHET_DISPATCH_CAPACITY": "8"})
    big, small = make_tenant(), make_tenant()
    slow = scripted_task([{"content": "done", "delay_ms": 200}])
    http = fleet.client()
    submit_many(http, big, [slow] * 600)
    started = time.monotonic()
    late = submit_many(http, small, [scripted_task(ANSWER)] * 20)
    done = wait_all(http, small.headers, late, timeout=120)
    took = time.monotonic() - started
    assert {t["status"] for t in done.values()} == {"succeeded"}
    left = unfinished(big)
    # In turn with the big tenant, the small one's 20 went through ~40 admissions: the big
    # tenant's backlog is still there (in one FIFO, all 600 would have gone first).
    assert left >= 300, f"the big tenant had only {left} left after {took:.1f} s"


FLOOD_DELAY_MS = 45_000  # far longer than the bound below: a step of the flood never ends in it


def wait_for_workers(http: httpx.Client, operator: TenantHandle, *, timeout: float = 30) -> int:
    """The fleet's step threads, once a worker has published its presence (the dispatcher
    counts its slots from there)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = http.get("/v1/admin/fleet", headers=operator.headers)
        assert response.status_code == 200, response.text
        threads = sum(int(w["threads"]) for w in response.json()["workers"])
        if threads:
            return threads
        time.sleep(0.1)
    raise AssertionError(f"no worker published its presence in {timeout} s")


def test_a_flood_of_slow_tasks_never_holds_every_slot_so_another_tenant_runs_at_once(
    stack: StackFactory, make_tenant: Callable[..., TenantHandle]
) -> None:
    # Default settings but a small worker: 4 step threads, no concurrency limit of any kind.
    # The flood asks for three times the fleet's threads, each step a 45 s model call.
    fleet = stack(
        workers=1,
        concurrency=1,
        env={"RATCHET_WORKER_THREADS": "4", "RATCHET_SHUTDOWN_GRACE_SECONDS": "0"},
    )
    hostile, other, operator = make_tenant(), make_tenant(), make_tenant(("operator",))
    http = fleet.client()
    assert wait_for_workers(http, operator) == 4
    flood = submit_many(
        http, hostile, [scripted_task([{"content": "slow", "delay_ms": FLOOD_DELAY_MS}])] * 12
    )
    deadline = time.monotonic() + 30
    while len(running(flood)) < 2:  # the flood holds what it may of the fleet
        assert time.monotonic() < deadline, "the flood never started"
        time.sleep(0.1)
    started = time.monotonic()
    ids = submit_many(http, other, [scripted_task(ANSWER)] * 6)
    # Without a default share the flood holds all four threads, and these wait 45 s for them.
    done = wait_all(http, other.headers, ids, timeout=20)
    took = time.monotonic() - started
    assert {t["status"] for t in done.values()} == {"succeeded"}, took
    assert len(running(flood)) <= 2  # half the fleet, never more
    assert unfinished(hostile) == len(flood)  # the flood's steps are still on their model calls


def running(ids: list[str]) -> set[str]:
    with transaction() as session:
        return set(
            session.scalars(select(Task.id).where(Task.id.in_(ids), Task.status == "running"))
        )


class Concurrency:
    """A model server's responder that answers after 300 ms and counts, per tenant label in
    the task's input, how many calls it holds at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.most_total = 0

    def __call__(self, request: Received) -> Reply:
        label = str(request.messages[-1]["content"]).split("]")[0].strip("[")
        with self.lock:
            self.now[label] += 1
            self.most[label] = max(self.most[label], self.now[label])
            self.most_total = max(self.most_total, sum(self.now.values()))
        time.sleep(0.3)
        with self.lock:
            self.now[label] -= 1
        return answer("done")


def test_concurrency_limits_hold_at_the_model_server_and_free_slots_serve_others(
    stack: StackFactory, make_tenant: Callable[..., TenantHandle]
) -> None:
    limited, other, pooled = make_tenant(), make_tenant(), make_tenant()
    concurrency = {
        "tenants": {limited.name: {"max_running": 3}},
        # a pool across two agents of one tenant
        "pools": {
            "crm": {"agents": ["default", "ops"], "tenants": [pooled.name], "max_running": 2}
        },
    }
    counter = Concurrency()
    with OpenAIServer(responder=counter) as server:
        fleet = stack(
            workers=1,
            concurrency=4,
            env={
                "RATCHET_CONCURRENCY": json.dumps(concurrency),
                "RATCHET_OPENAI_BASE_URL": server.base_url,
                "RATCHET_OPENAI_API_KEY": "sk-test",
            },
        )
        http = fleet.client()

        def body(label: str, agent: str = "default") -> dict[str, Any]:
            return {
                "input": f"[{label}] hello",
                "model": "openai:gpt-4o-mini",
                "agent": agent,
                "tools": [],
            }

        ids = submit_many(http, limited, [body("A")] * 15)
        ids += submit_many(http, other, [body("B")] * 15)
        ids += submit_many(http, pooled, [body("C"), body("C", agent="ops")] * 5)
        for tenant, some in ((limited, ids[:15]), (other, ids[15:30]), (pooled, ids[30:])):
            done = wait_all(http, tenant.headers, some, timeout=120)
            assert {t["status"] for t in done.values()} == {"succeeded"}
    assert counter.most["A"] == 3  # never more than its limit, and it used it
    assert counter.most["C"] <= 2  # the pool, across its two agents
    assert counter.most_total > 3  # the other slots served the other tenants meanwhile


def leader_pid(fleet: Stack) -> int | None:
    with transaction() as session:
        row = session.get(Leader, f"dispatch:{fleet.env['RATCHET_QUEUE_NAME']}")
        if row is None or row.expires_ms < time.time() * 1000:
            return None
        return int(row.owner.split("/")[1])


def test_killing_the_dispatcher_mid_backlog_loses_nothing_and_admits_nothing_twice(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    fleet = stack(
        workers=2,
        concurrency=1,
        env={
            "RATCHET_SWEEP_INTERVAL_SECONDS": "1",
            "RATCHET_DISPATCH_CAPACITY": "6",
            # One tenant alone: the whole fleet is its (no default share holds it back).
            "RATCHET_TENANT_DEFAULT_SHARE": "1",
        },
    )
    http = fleet.client()
    ids = submit_many(http, tenant, [scripted_task([{"content": "done", "delay_ms": 20}])] * 2000)
    deadline = time.monotonic() + 30
    while (pid := leader_pid(fleet)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pid is not None
    (index,) = [i for i, p in enumerate(fleet.worker_procs) if p.pid == pid]
    fleet.kill_worker(index)
    killed_at = time.monotonic()
    while leader_pid(fleet) in (None, pid):
        assert time.monotonic() - killed_at < 15, "no other worker took the dispatch over"
        time.sleep(0.05)
    deadline = time.monotonic() + 240
    while unfinished(tenant) and time.monotonic() < deadline:
        time.sleep(0.5)
    with transaction() as session:
        statuses = Counter(session.scalars(select(Task.status).where(Task.id.in_(ids))))
    assert statuses == {"succeeded": len(ids)}, statuses
    with transaction() as session:
        started = session.execute(
            select(TaskEvent.task_id, func.count())
            .where(TaskEvent.task_id.in_(ids), TaskEvent.type == "task.started")
            .group_by(TaskEvent.task_id)
        ).all()
        steps = set(session.scalars(select(Task.steps).where(Task.id.in_(ids))))
    assert sorted(n for _, n in started) == [1] * len(ids)  # each started once
    assert steps == {1}


def test_a_schedule_fires_once_per_tick_through_a_kill(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    # A tick every 2 s: the operator lowered the schedules' minimum interval (60 s) to 1 s.
    env = {"RATCHET_SWEEP_INTERVAL_SECONDS": "1", "RATCHET_SCHEDULE_MIN_INTERVAL_SECONDS": "1"}
    fleet = stack(workers=3, concurrency=1, env=env)
    http = fleet.client()
    response = http.post(
        "/v1/schedules",
        json={"name": "every-2s", "cron": "* * * * * */2", "task": scripted_task(ANSWER)},
        headers=tenant.headers,
    )
    assert response.status_code == 201, response.text
    schedule_id = response.json()["id"]
    start_ms = int(time.time() * 1000)
    time.sleep(15)
    pid = leader_pid(fleet)
    assert pid is not None
    (index,) = [i for i, p in enumerate(fleet.worker_procs) if p.pid == pid]
    fleet.kill_worker(index)
    time.sleep(max(0.0, start_ms / 1000 + 30 - time.time()))
    end_ms = start_ms + 30_000
    time.sleep(3)  # ticks of the window that a takeover made late
    http.post(f"/v1/schedules/{schedule_id}/pause", headers=tenant.headers)
    with transaction() as session:
        keys = list(
            session.scalars(select(Task.idempotency_key).where(Task.schedule_id == schedule_id))
        )
    ticks = [int(str(k).rsplit(":", 1)[1]) for k in keys]
    assert len(ticks) == len(set(ticks)), "a tick fired twice"
    in_window = [t for t in ticks if start_ms <= t < end_ms]
    assert 14 <= len(in_window) <= 16, sorted(in_window)


def test_tasks_waiting_on_a_rate_limit_hold_none_of_their_tenants_slots(
    stack: StackFactory, make_tenant: Callable[..., TenantHandle]
) -> None:
    tenant = make_tenant()
    concurrency = {"tenants": {tenant.name: {"max_running": 2}}}
    # One call of the OpenAI model per ten minutes: all but one of its tasks wait.
    rates = {"models": {"openai:*": {"requests": 1, "per_seconds": 600}}}
    with OpenAIServer(responder=lambda _: answer("done")) as server:
        fleet = stack(
            workers=1,
            concurrency=2,
            env={
                "RATCHET_CONCURRENCY": json.dumps(concurrency),
                "RATCHET_RATE_LIMITS": json.dumps(rates),
                "RATCHET_RATE_LIMIT_INLINE_WAIT_MS": "0",
                "RATCHET_OPENAI_BASE_URL": server.base_url,
                "RATCHET_OPENAI_API_KEY": "sk-test",
            },
        )
        http = fleet.client()
        limited = {"input": "hello", "model": "openai:gpt-4o-mini", "tools": []}
        waiting = submit_many(http, tenant, [limited] * 50)
        time.sleep(2)  # the limiter has turned them away
        others = submit_many(http, tenant, [scripted_task(ANSWER)] * 10)
        done = wait_all(http, tenant.headers, others, timeout=120)
        assert {t["status"] for t in done.values()} == {"succeeded"}
        with transaction() as session:
            statuses = Counter(session.scalars(select(Task.status).where(Task.id.in_(waiting))))
        assert statuses["succeeded"] <= 1
        assert statuses["running"] + statuses["queued"] >= 49  # still waiting for a token
