"""``ratchet bench capacity``: model calls in flight on one worker host against a slow model.

One ``ratchet api`` and one ``ratchet worker`` (its defaults, nothing tuned) against a model
that answers after a fixed latency (:mod:`benchmarks.servers.llm_stub`). Hundreds of tasks are
submitted at once; what counts is how many model calls the one worker host keeps in flight,
measured by the provider, beside the Postgres connections and memory that cost.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
import typer

from benchmarks.harness.common import (
    TASK_BODY,
    bench_key,
    drop_queue,
    drop_tenant,
    emit,
    host,
    summary,
)
from benchmarks.harness.processes import (
    Child,
    free_port,
    machine_busy_seconds,
    tree_cpu_seconds,
    wait_ok,
)
from benchmarks.harness.sampler import Sampler, pg_port

# The limiter stays on (every call passes its buckets) but can never say "wait", whatever
# limits the environment configures for OpenAI models or for every tenant.
UNTHROTTLED = {
    "models": {
        model: {"requests": 1e12, "tokens": 1e15} for model in ("openai:*", TASK_BODY["model"])
    },
    "tenants": {"*": {"requests": 1e12, "tokens": 1e15, "submissions": 1e12}},
}


@dataclass
class Submitted:
    """What the submitters did: task ids, when the first went out, and how it went."""

    started: float
    seconds: float = 0.0
    ids: list[str] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, ids: list[str], *, latencies_ms: list[float], errors: Counter[str]) -> None:
        with self._lock:
            self.ids += ids
            self.latencies_ms += latencies_ms
            self.errors.update(errors)


def _submit_lane(url: str, key: str, *, count: int, out: Submitted) -> None:
    """One submitter: its share of the tasks on one keep-alive client, each latency noted,
    and every failure counted rather than raised, so one refusal does not end the run."""
    ids: list[str] = []
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        for _ in range(count):
            started = time.perf_counter()
            try:
                response = client.post("/v1/tasks", json=TASK_BODY)
            except httpx.HTTPError as exc:
                errors[type(exc).__name__] += 1
                continue
            latencies.append((time.perf_counter() - started) * 1000)
            if response.status_code == 202:
                ids.append(response.json()["id"])
            else:
                errors[str(response.status_code)] += 1
    out.add(ids, latencies_ms=latencies, errors=errors)


def _submit_all(url: str, key: str, *, tasks: int, submitters: int) -> Submitted:
    """Submit ``tasks`` tasks over HTTP from ``submitters`` threads, each keeping its
    connection alive."""
    shares = [tasks // submitters + (i < tasks % submitters) for i in range(submitters)]
    out = Submitted(started=time.time())
    with ThreadPoolExecutor(submitters) as pool:
        for future in [pool.submit(_submit_lane, url, key, count=n, out=out) for n in shares]:
            future.result()  # a lane's unexpected error is the run's
    out.seconds = time.time() - out.started
    return out


def _progress(ids: Sequence[str]) -> tuple[Counter[str], float | None]:
    """The tasks' statuses and the latest finish among them (epoch seconds), from the
    database: one query instead of a GET per task."""
    from sqlalchemy import func, select

    from shared.store.db import transaction
    from shared.store.tables import Task

    query = select(Task.status, func.count(), func.max(Task.finished_at))
    with transaction() as session:
        rows = session.execute(query.where(Task.id.in_(ids)).group_by(Task.status)).all()
    finished = [last.timestamp() for _, _, last in rows if last is not None]
    return Counter({status: count for status, count, _ in rows}), max(finished, default=None)


def _wait_terminal(ids: Sequence[str], *, deadline: float) -> tuple[Counter[str], float | None]:
    from shared.statuses import TERMINAL_STATUSES

    while True:
        statuses, last = _progress(ids)
        done = sum(statuses[s] for s in TERMINAL_STATUSES)
        if done == len(ids) or time.time() >= deadline:
            return statuses, last
        time.sleep(0.5)


def _warm_up(url: str, key: str, *, worker: Child, timeout: float) -> None:
    """Run one task end to end. This is how the worker is known to be ready: Celery logs
    "ready." at INFO, below the WARNING the worker runs at; and the first task pays for the
    imports and connections no measured task should."""
    from shared.statuses import TERMINAL_STATUSES, TaskStatus

    submitted = _submit_all(url, key, tasks=1, submitters=1)
    if not submitted.ids:
        raise RuntimeError(f"the warm-up task was not accepted: {dict(submitted.errors)}")
    deadline = time.time() + timeout
    while time.time() < deadline:
        worker.check()
        statuses, _ = _progress(submitted.ids)
        if statuses[TaskStatus.SUCCEEDED]:
            return
        if any(statuses[s] for s in TERMINAL_STATUSES):
            raise RuntimeError(f"the warm-up task ended {dict(statuses)}:\n{worker.tail()}")
        time.sleep(0.2)
    raise RuntimeError(f"the warm-up task did not finish in {timeout} s:\n{worker.tail()}")


def _capacity_env(*, queue: str) -> dict[str, str]:
    """The caller's environment with a private queue, a key for the stub and limits that
    never throttle (the stub's URL is added once its port is known)."""
    return {
        **os.environ,
        "RATCHET_QUEUE_NAME": queue,
        "RATCHET_OPENAI_API_KEY": "bench",
        "RATCHET_RATE_LIMITS": json.dumps(UNTHROTTLED),
    }


@dataclass(frozen=True)
class Scenario:
    """The capacity run's shape: how many tasks, how slow the model, how many steps each."""

    tasks: int
    latency_ms: int
    tool_steps: int
    submitters: int
    timeout_factor: float

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1000

    @property
    def ideal_s(self) -> float:
        """A task's time if nothing but the model took any: one call per step."""
        return (self.tool_steps + 1) * self.latency_s


@dataclass
class CapacityRun:
    """One run's raw figures, turned into the report by :func:`_capacity_report`."""

    scenario: Scenario
    submitted: Submitted
    statuses: Counter[str]
    last_finished: float | None
    deadline: float
    stub: dict[str, Any]
    series: dict[str, list[float]]
    missed_samples: int
    host: dict[str, Any]
    cpu: dict[str, float]  # seconds over the run: the worker's tree, the API, the machine


def _stats_of(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"max": None, "mean": None}
    return {"max": max(values), "mean": round(statistics.fmean(values), 1)}


def _pg_figures(series: dict[str, list[float]]) -> dict[str, Any]:
    by_name = _stats_of(series["pg_by_name"])
    figures: dict[str, Any] = {"worker_pg_connections": by_name}
    if not by_name["max"]:
        figures["worker_pg_connections"] = None
        figures["worker_pg_connections_note"] = (
            "no row of pg_stat_activity had application_name LIKE 'ratchet-worker%' during "
            "the run: the worker names no connection; see worker_pg_connections_by_socket"
        )
    figures["worker_pg_connections_by_socket"] = _stats_of(series["pg_by_socket"])
    return figures


def _capacity_report(run: CapacityRun) -> dict[str, Any]:
    """The figures and the targets. A run that timed out is measured up to its deadline."""
    from shared.statuses import TERMINAL_STATUSES, TaskStatus

    scenario, submitted, stub = run.scenario, run.submitted, run.stub
    finished = sum(run.statuses[s] for s in TERMINAL_STATUSES)
    timed_out = finished < len(submitted.ids)
    end = run.deadline if timed_out or run.last_finished is None else run.last_finished
    wall = end - submitted.started
    return {
        "tasks": scenario.tasks,
        "submitted": len(submitted.ids),
        "submit_errors": dict(submitted.errors),
        "submit_seconds": round(submitted.seconds, 2),
        "submit_ms": summary(submitted.latencies_ms),
        "succeeded": run.statuses[TaskStatus.SUCCEEDED],
        "failed": run.statuses[TaskStatus.FAILED],
        "unfinished": len(submitted.ids) - finished,
        "timed_out": timed_out,
        "wall_seconds": round(wall, 2),
        "ideal_seconds": scenario.ideal_s,
        "wall_to_ideal": round(wall / scenario.ideal_s, 2),
        "model_calls": stub["calls"],
        "expected_model_calls": scenario.tasks * (scenario.tool_steps + 1),
        "avg_in_flight_littles_law": round(stub["calls"] * scenario.latency_s / wall, 1),
        "avg_in_flight_measured": round(stub["busy_seconds"] / wall, 1),
        "peak_in_flight": stub["peak"],
        "sampled_in_flight": _stats_of(run.series["in_flight"]),
        "in_flight_every_half_second": [int(n) for n in run.series["in_flight"]],
        **_pg_figures(run.series),
        **_cpu_figures(run.cpu, calls=stub["calls"], wall=wall),
        "worker_rss_mb_max": round(max(run.series["rss_mb"], default=0.0), 1),
        "worker_processes_max": max(run.series["processes"], default=0),
        "samples": len(run.series["rss_mb"]),
        "missed_samples": run.missed_samples,
        "target": "wall <= 12 s, avg in flight >= 250, <= 20 PG connections, <= 1024 MB RSS",
        "host": run.host,
    }


def _cpu_now(worker: Child, api: Child) -> dict[str, float]:
    return {
        "worker": tree_cpu_seconds(worker.pid),
        "api": tree_cpu_seconds(api.pid),
        "machine": machine_busy_seconds(),
    }


def _cpu_figures(cpu: dict[str, float], *, calls: int, wall: float) -> dict[str, Any]:
    """Where the run's CPU went: the worker host's per model call (what sizes a fleet),
    the API's, and how busy the machine's cores were (a saturated machine is the limit)."""
    cores = os.cpu_count() or 1
    return {
        "worker_cpu_seconds": round(cpu["worker"], 2),
        "worker_cpu_ms_per_model_call": round(1000 * cpu["worker"] / calls, 2) if calls else None,
        "api_cpu_seconds": round(cpu["api"], 2),
        "machine_busy_share": round(cpu["machine"] / (wall * cores), 2) if wall else None,
    }


def _measure_capacity(
    url: str, key: str, *, stack: tuple[Child, Child], stub_url: str, scenario: Scenario
) -> CapacityRun:
    """Submit every task, sample while they run, wait until all are terminal (or the
    deadline), then read the provider's counters."""
    api, worker = stack
    _warm_up(url, key, worker=worker, timeout=60 + 5 * scenario.ideal_s)
    httpx.post(f"{stub_url}/stats/reset")
    machine = host()
    sampler = Sampler(stub_url=stub_url, worker_pid=worker.pid, pg_port=pg_port())
    with sampler:
        cpu = _cpu_now(worker, api)
        submitted = _submit_all(url, key, tasks=scenario.tasks, submitters=scenario.submitters)
        deadline = submitted.started + scenario.timeout_factor * scenario.ideal_s
        statuses, last = _wait_terminal(submitted.ids, deadline=deadline)
        stub = httpx.get(f"{stub_url}/stats").json()
        cpu = {name: value - cpu[name] for name, value in _cpu_now(worker, api).items()}
    return CapacityRun(
        scenario=scenario,
        submitted=submitted,
        statuses=statuses,
        last_finished=last,
        deadline=deadline,
        stub=stub,
        series=sampler.series,
        missed_samples=sampler.missed,
        host=machine,
        cpu=cpu,
    )


def _start_stack(
    stack: ExitStack, scenario: Scenario, *, env: dict[str, str]
) -> tuple[str, str, tuple[Child, Child]]:
    """The stub model, one API process and one worker with the product's defaults; returns
    the stub's URL, the API's URL, and the API and the worker, once the first two answer."""
    stub_port, api_port = free_port(), free_port()
    env = {**env, "RATCHET_OPENAI_BASE_URL": f"http://127.0.0.1:{stub_port}/v1"}
    stub = stack.enter_context(
        Child(
            "benchmarks.servers.llm_stub",
            *("--port", str(stub_port), "--latency-ms", str(scenario.latency_ms)),
            *("--tool-steps", str(scenario.tool_steps)),
            env=env,
        )
    )
    api = stack.enter_context(Child("ratchet", "api", "--port", str(api_port), env=env))
    worker = stack.enter_context(Child("ratchet", "worker", "--loglevel", "WARNING", env=env))
    stub_url, api_url = f"http://127.0.0.1:{stub_port}", f"http://127.0.0.1:{api_port}"
    wait_ok(f"{stub_url}/stats", stub)
    wait_ok(f"{api_url}/readyz", api)
    return stub_url, api_url, (api, worker)


def capacity(
    *,
    tasks: int = typer.Option(500, help="tasks submitted at once"),
    latency_ms: int = typer.Option(2000, help="the stub model's latency per call"),
    tool_steps: int = typer.Option(2, help="tool calls before each task's final answer"),
    submitters: int = typer.Option(16, help="threads submitting over HTTP"),
    timeout_factor: float = typer.Option(20.0, help="give up after this many ideal times"),
) -> None:
    """Model calls in flight on one worker host (its defaults) against a slow model."""
    scenario = Scenario(
        tasks=tasks,
        latency_ms=latency_ms,
        tool_steps=tool_steps,
        submitters=submitters,
        timeout_factor=timeout_factor,
    )
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    env = _capacity_env(queue=queue)
    tenant_id, key = bench_key()
    try:
        with ExitStack() as stack:
            stub_url, url, children = _start_stack(stack, scenario, env=env)
            run = _measure_capacity(url, key, stack=children, stub_url=stub_url, scenario=scenario)
    finally:
        drop_tenant(tenant_id)
        drop_queue(queue)
    emit("capacity", _capacity_report(run))
