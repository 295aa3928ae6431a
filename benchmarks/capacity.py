"""``ratchet bench capacity``: model calls in flight on one worker host against a slow model.

One ``ratchet api`` and one ``ratchet worker`` (its defaults, nothing tuned) against a model
that answers after a fixed latency (:mod:`benchmarks.servers.llm_stub`). Hundreds of tasks are
submitted at once; what counts is how many model calls the one worker host keeps in flight,
measured by the provider, beside the Postgres connections and memory that cost.

``--http-tool`` is the workload of real agents' tools: each task is a model call, an
``http_request`` to a receiver that answers after a few ms, and a model call (300 tasks). It
reports the time from the last accepted submission to the last task's end, and the CPU of
every Ratchet process (the worker's tree and the API) per model call; then the same tasks as a
LangGraph graph checkpointed by ``AsyncPostgresSaver`` in one asyncio process, all at once,
on a shared HTTP client: the baseline. ``--code DIR`` runs the API and the worker from
another checkout (a worktree of an earlier commit), for before/after pairs in one session.

``--stream-chunks N`` runs the workload twice in one session: model calls not streaming
(``RATCHET_STREAM_DEFAULT=false``), then streaming, the stub sending each answer in ``N``
pieces over its latency; it reports both runs and the ratios of streaming to not (calls in
flight, and the worker host's CPU per model call).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
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
    libpq_url,
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
    last_accepted: float = 0.0  # epoch seconds: when the last 202 arrived
    ids: list[str] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(
        self,
        ids: list[str],
        *,
        latencies_ms: list[float],
        errors: Counter[str],
        last_accepted: float = 0.0,
    ) -> None:
        with self._lock:
            self.last_accepted = max(self.last_accepted, last_accepted)
            self.ids += ids
            self.latencies_ms += latencies_ms
            self.errors.update(errors)


def _submit_lane(
    url: str, key: str, *, count: int, out: Submitted, body: dict[str, Any] = TASK_BODY
) -> None:
    """One submitter: its share of the tasks on one keep-alive client, each latency noted,
    and every failure counted rather than raised, so one refusal does not end the run."""
    ids: list[str] = []
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    last_accepted = 0.0
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        for _ in range(count):
            started = time.perf_counter()
            try:
                response = client.post("/v1/tasks", json=body)
            except httpx.HTTPError as exc:
                errors[type(exc).__name__] += 1
                continue
            latencies.append((time.perf_counter() - started) * 1000)
            if response.status_code == 202:
                ids.append(response.json()["id"])
                last_accepted = time.time()
            else:
                errors[str(response.status_code)] += 1
    out.add(ids, latencies_ms=latencies, errors=errors, last_accepted=last_accepted)


def _submit_all(
    url: str, key: str, *, tasks: int, submitters: int, body: dict[str, Any] = TASK_BODY
) -> Submitted:
    """Submit ``tasks`` tasks over HTTP from ``submitters`` threads, each keeping its
    connection alive."""
    shares = [tasks // submitters + (i < tasks % submitters) for i in range(submitters)]
    out = Submitted(started=time.time())
    with ThreadPoolExecutor(submitters) as pool:
        lanes = [pool.submit(_submit_lane, url, key, count=n, out=out, body=body) for n in shares]
        for future in lanes:
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


def _warm_up(
    url: str, key: str, *, worker: Child, timeout: float, body: dict[str, Any] = TASK_BODY
) -> None:
    """Run one task end to end. This is how the worker is known to be ready: Celery logs
    "ready." at INFO, below the WARNING the worker runs at; and the first task pays for the
    imports and connections no measured task should."""
    from shared.statuses import TERMINAL_STATUSES, TaskStatus

    submitted = _submit_all(url, key, tasks=1, submitters=1, body=body)
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
        # The HTTP tool's receiver is the stub, on loopback.
        "RATCHET_HTTP_ALLOWED_HOSTS": "127.0.0.1",
    }


@dataclass(frozen=True)
class Scenario:
    """The capacity run's shape: how many tasks, how slow the model, how many steps each."""

    tasks: int
    latency_ms: int
    tool_steps: int
    submitters: int
    timeout_factor: float
    http_tool: bool = False
    code: str | None = None  # the checkout the API and the worker run from; None: this one
    # Streamed answers: the stub's pieces an answer (0: it answers whole), and whether the
    # worker asks for a stream (None: the product's default).
    chunks: int = 0
    stream: bool | None = None

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1000

    @property
    def body(self) -> dict[str, Any]:
        """What each task is submitted as."""
        return {**TASK_BODY, "tools": ["http_request"]} if self.http_tool else TASK_BODY

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
    peer: dict[str, Any] | None = None  # the LangGraph baseline's figures, if run


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
    } | (_http_tool_figures(run, end=end) if scenario.http_tool else {})


def _http_tool_figures(run: CapacityRun, *, end: float) -> dict[str, Any]:
    """The HTTP-tool workload's own figures and targets, and its LangGraph baseline's."""
    calls = run.stub["calls"]
    ratchet_cpu = run.cpu["worker"] + run.cpu["api"]
    figures: dict[str, Any] = {
        "workload": "model -> http_request -> model",
        "code": run.scenario.code or "this checkout",
        "receiver_calls": run.stub.get("receiver_calls"),
        "after_last_submission_seconds": round(end - run.submitted.last_accepted, 2),
        "ratchet_cpu_seconds": round(ratchet_cpu, 2),
        "ratchet_cpu_ms_per_model_call": round(1000 * ratchet_cpu / calls, 2) if calls else None,
        "target": "<= 6 s after the last accepted submission, <= 8 ms of Ratchet CPU a model call",
    }
    peer = run.peer
    if peer is not None and "error" in peer:
        figures["langgraph"] = peer
    elif peer is not None:
        figures["langgraph"] = {
            "seconds": round(peer["seconds"], 2),
            "model_calls": peer["model_calls"],
            "avg_in_flight_measured": round(peer["busy_seconds"] / peer["seconds"], 1),
            "peak_in_flight": peer["peak"],
            "cpu_seconds": round(peer["cpu_seconds"], 2),
            "cpu_ms_per_model_call": round(1000 * peer["cpu_seconds"] / peer["model_calls"], 2)
            if peer["model_calls"]
            else None,
            "machine_busy_share": round(
                peer["machine_busy_seconds"] / (peer["seconds"] * (os.cpu_count() or 1)), 2
            ),
        }
    return figures


def _run_peer(stub_url: str, scenario: Scenario) -> dict[str, Any]:
    """The LangGraph baseline on the same stub: its figures and the stub's counters."""
    from benchmarks.servers import langgraph_peer

    httpx.post(f"{stub_url}/stats/reset")
    try:
        figures = langgraph_peer.measure_http(
            stub_url, count=scenario.tasks, connections=PEER_CONNECTIONS, url=libpq_url()
        )
    except RuntimeError as exc:  # Ratchet's figures are still reported
        return {"error": str(exc)[-1500:]}
    finally:
        langgraph_peer.drop(libpq_url())
    # The warm-up's calls are before its span: the span's are all the rest, counted apart.
    stats = httpx.get(f"{stub_url}/stats").json()
    calls = scenario.tasks * (scenario.tool_steps + 1)
    return figures | {
        "model_calls": calls,
        "peak": stats["peak"],
        "busy_seconds": stats["busy_seconds"] * calls / max(stats["calls"], 1),
    }


# As many connections as a default worker host holds at most (the capacity run's figure).
PEER_CONNECTIONS = 16


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
    body = scenario.body
    _warm_up(url, key, worker=worker, timeout=60 + 5 * scenario.ideal_s, body=body)
    httpx.post(f"{stub_url}/stats/reset")
    machine = host()
    sampler = Sampler(stub_url=stub_url, worker_pid=worker.pid, pg_port=pg_port())
    with sampler:
        cpu = _cpu_now(worker, api)
        submitted = _submit_all(
            url, key, tasks=scenario.tasks, submitters=scenario.submitters, body=body
        )
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
            *(("--http-tool",) if scenario.http_tool else ()),
            *("--chunks", str(scenario.chunks)),
            env=env,
        )
    )
    if scenario.stream is not None:
        env = {**env, "RATCHET_STREAM_DEFAULT": str(scenario.stream).lower()}
    with _running_from(scenario.code, env) as ratchet_env:
        api = stack.enter_context(Child("ratchet", "api", "--port", str(api_port), env=ratchet_env))
        worker = stack.enter_context(
            Child("ratchet", "worker", "--loglevel", "WARNING", env=ratchet_env)
        )
    stub_url, api_url = f"http://127.0.0.1:{stub_port}", f"http://127.0.0.1:{api_port}"
    wait_ok(f"{stub_url}/stats", stub)
    wait_ok(f"{api_url}/readyz", api)
    return stub_url, api_url, (api, worker)


@contextlib.contextmanager
def _running_from(code: str | None, env: dict[str, str]) -> Iterator[dict[str, str]]:
    """The environment (and, while inside, the working directory, which ``python -m`` puts
    first on the path) for Ratchet's processes to run from the checkout ``code``."""
    if code is None:
        yield env
        return
    here = os.getcwd()
    os.chdir(code)
    try:
        yield {**env, "PYTHONPATH": os.path.abspath(code)}
    finally:
        os.chdir(here)


def capacity(
    *,
    tasks: int = typer.Option(None, help="tasks submitted at once (500; 300 with --http-tool)"),
    latency_ms: int = typer.Option(2000, help="the stub model's latency per call"),
    tool_steps: int = typer.Option(
        None, help="tool calls before each task's final answer (2; 1 with --http-tool)"
    ),
    submitters: int = typer.Option(16, help="threads submitting over HTTP"),
    timeout_factor: float = typer.Option(20.0, help="give up after this many ideal times"),
    http_tool: bool = typer.Option(
        False, "--http-tool", help="tool calls are http_request to a receiver on loopback"
    ),
    baseline: bool = typer.Option(
        True, help="with --http-tool, also run the LangGraph + AsyncPostgresSaver baseline"
    ),
    code: str = typer.Option(
        None, help="run the API and the worker from this checkout (e.g. an earlier commit's)"
    ),
    stream_chunks: int = typer.Option(
        0, help="run twice, model calls not streaming then streaming in this many pieces"
    ),
) -> None:
    """Model calls in flight on one worker host (its defaults) against a slow model."""
    scenario = Scenario(
        tasks=tasks if tasks is not None else (300 if http_tool else 500),
        latency_ms=latency_ms,
        tool_steps=tool_steps if tool_steps is not None else (1 if http_tool else 2),
        submitters=submitters,
        timeout_factor=timeout_factor,
        http_tool=http_tool,
        code=code,
    )
    if stream_chunks:
        _streaming_or_not(scenario, chunks=stream_chunks)
        return
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    env = _capacity_env(queue=queue)
    tenant_id, key = bench_key()
    try:
        with ExitStack() as stack:
            stub_url, url, children = _start_stack(stack, scenario, env=env)
            run = _measure_capacity(url, key, stack=children, stub_url=stub_url, scenario=scenario)
            if http_tool and baseline:
                run.peer = _run_peer(stub_url, scenario)
    finally:
        drop_tenant(tenant_id)
        drop_queue(queue)
    emit("capacity-http-tool" if http_tool else "capacity", _capacity_report(run))


def _streaming_or_not(scenario: Scenario, *, chunks: int) -> None:
    """The workload not streaming, then streaming in ``chunks`` pieces an answer, each on a
    stack of its own; both reports and the ratios of streaming to not."""
    reports = {}
    for name, mode in (
        ("off", replace(scenario, stream=False)),
        ("on", replace(scenario, stream=True, chunks=chunks)),
    ):
        queue = f"bench-{uuid.uuid4().hex[:8]}"
        tenant_id, key = bench_key()
        try:
            with ExitStack() as stack:
                stub_url, url, children = _start_stack(stack, mode, env=_capacity_env(queue=queue))
                run = _measure_capacity(url, key, stack=children, stub_url=stub_url, scenario=mode)
        finally:
            drop_tenant(tenant_id)
            drop_queue(queue)
        reports[name] = _capacity_report(run)
    off, on = reports["off"], reports["on"]

    def ratio(name: str) -> float | None:
        return round(on[name] / off[name], 2) if on.get(name) and off.get(name) else None

    emit(
        "capacity-stream",
        {
            "chunks_per_answer": chunks,
            "in_flight_on_to_off": ratio("avg_in_flight_measured"),
            "peak_in_flight_on_to_off": ratio("peak_in_flight"),
            "worker_cpu_per_call_on_to_off": ratio("worker_cpu_ms_per_model_call"),
            "target": "calls in flight streaming >= 0.9x not streaming",
            "off": off,
            "on": on,
        },
    )
