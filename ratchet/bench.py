"""``ratchet bench``: measurements reported as ratios to a baseline taken in the same run.

- ``checkpoint``: the per-step cost of the checkpoint path (lease, model-response commit, tool
  ledger, step commit) with the scripted model at 0 ms, against a bare single-row
  INSERT + COMMIT on the same Postgres; commits per step; bytes written per step by step number.
- ``limiter``: rate-limiter decisions per second and latency at 1, 16 and 64 concurrent clients
  across processes, against a bare Redis INCR with the same client; and the admitted count of
  a saturated bucket against its configured rate.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import typer

app = typer.Typer(
    no_args_is_help=True, help="Benchmarks (figures are ratios to a same-run baseline)."
)


@app.callback()
def _benchmark_settings() -> None:
    # The benchmarks drive tasks with the scripted model, in this process and in the API and
    # worker processes they start (which inherit this environment); production keeps it off.
    os.environ.setdefault("RATCHET_SCRIPTED_MODEL", "true")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "mean": statistics.fmean(values) if values else float("nan"),
    }


def emit(name: str, result: dict[str, Any]) -> None:
    os.makedirs("bench-results", exist_ok=True)
    path = os.path.join("bench-results", f"{name}.json")
    with open(path, "w") as handle:
        json.dump(result, handle, indent=2)
    typer.echo(json.dumps(result, indent=2))
    typer.echo(f"(written to {path})", err=True)


# --- checkpoint --------------------------------------------------------------------------


def _unwrapped(value: Any) -> Any:
    return getattr(value, "obj", None) if hasattr(value, "obj") else str(value)


@dataclass
class WriteMeter:
    """Counts write transactions and the bytes of written parameters, per label."""

    label: str = ""
    commits: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _dirty: set[int] = field(default_factory=set)

    def install(self, engine: Any) -> None:
        from sqlalchemy import event

        from shared.store import db

        def observe(conn: Any, statement: str, params: Any) -> None:
            words = statement.lstrip().upper()
            if not words.startswith(("INSERT", "UPDATE", "DELETE")) and not (
                words.startswith("WITH") and any(v in words for v in ("INSERT", "UPDATE"))
            ):
                return
            # psycopg's Jsonb wrapper prints abbreviated: measure what it wraps
            self.bytes[self.label] += len(json.dumps(params, default=_unwrapped))
            if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
                self.commits[self.label] += 1  # a write statement in autocommit commits alone
            else:
                self._dirty.add(id(conn))

        @event.listens_for(engine, "before_cursor_execute")
        def _execute(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
            observe(conn, statement, params)

        db.statement_observers.append(observe)  # the statements the step path sends itself

        @event.listens_for(engine, "commit")
        def _commit(conn: Any) -> None:
            if id(conn) in self._dirty:
                self._dirty.discard(id(conn))
                self.commits[self.label] += 1

        @event.listens_for(engine, "rollback")
        def _rollback(conn: Any) -> None:
            self._dirty.discard(id(conn))

    @contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        self.label = label
        try:
            yield
        finally:
            self.label = ""


def _bench_tenant() -> str:
    from shared.store.db import transaction
    from shared.store.tenants import create_tenant

    with transaction() as session:
        return create_tenant(session, f"bench-{uuid.uuid4().hex[:8]}").id


def _new_task(tenant_id: str, script: list[dict[str, Any]]) -> str:
    from shared.store.db import transaction
    from shared.store.tasks import NewTask, create_task

    spec = NewTask(
        agent="default",
        model="scripted",
        input="benchmark",
        instructions=None,
        tools=["calculator"],
        model_options={"script": script},
        max_steps=len(script) + 1,
        budget=None,
        webhook=None,
        metadata={},
    )
    with transaction() as session:
        return create_task(session, tenant_id, spec).id


class Baseline:
    """A bare single-row INSERT + COMMIT through the same engine, sampled between steps so
    both see the same machine (these machines are noisy)."""

    def __init__(self) -> None:
        from sqlalchemy import text

        from shared.store.db import get_engine

        self.timings: list[float] = []
        self._insert = text("INSERT INTO bench_baseline (v) VALUES (:v)")
        with get_engine().begin() as conn:
            conn.execute(
                text("CREATE TABLE IF NOT EXISTS bench_baseline (id bigserial PRIMARY KEY, v text)")
            )

    def sample(self) -> None:
        from shared.store.db import transaction

        started = time.perf_counter()
        with transaction() as session:
            session.execute(self._insert, {"v": f"row {len(self.timings)}"})
        self.timings.append((time.perf_counter() - started) * 1000)

    def drop(self) -> None:
        from sqlalchemy import text

        from shared.store.db import get_engine

        with get_engine().begin() as conn:
            conn.execute(text("DROP TABLE bench_baseline"))


class DriverBaseline:
    """The same INSERT + COMMIT straight through psycopg on a connection of its own: the
    floor under any client library, reported beside the baseline above."""

    def __init__(self) -> None:
        import psycopg

        from shared.store.db import get_engine

        url = get_engine().url.set(drivername="postgresql").render_as_string(hide_password=False)
        self.timings: list[float] = []
        self._connection = psycopg.connect(url)

    def sample(self) -> None:
        started = time.perf_counter()
        self._connection.execute(
            "INSERT INTO bench_baseline (v) VALUES (%s)", (f"row {len(self.timings)}",)
        )
        self._connection.commit()
        self.timings.append((time.perf_counter() - started) * 1000)

    def close(self) -> None:
        self._connection.close()


def _cleanup(tenant_id: str) -> None:
    from shared.store.db import transaction
    from shared.store.tables import Tenant

    with transaction() as session:
        tenant = session.get(Tenant, tenant_id)
        if tenant is not None:
            session.delete(tenant)


def _time_steps(
    task_id: str,
    steps: int,
    *,
    out: dict[int, list[float]],
    baselines: Sequence[Baseline | DriverBaseline],
    meter: WriteMeter | None = None,
) -> None:
    """Run the task's steps, timing each; after each, one sample of every baseline."""
    from workers.step_runner import advance

    for number in range(1, steps + 1):
        with meter.labelled(f"step{number}") if meter else nullcontext():
            started = time.perf_counter()
            advance(task_id, number)
            out[number].append((time.perf_counter() - started) * 1000)
        for baseline in baselines:
            baseline.sample()


_DONE: list[dict[str, Any]] = [{"content": "done"}]
_CALL: dict[str, Any] = {"tool_calls": [{"name": "calculator", "arguments": {"expression": "1+1"}}]}


@app.command()
def checkpoint(
    tasks: int = typer.Option(300, help="one-step tasks (the no-tools scenario)"),
    chains: int = typer.Option(10, help="tasks in the chain scenario"),
    steps: int = typer.Option(50, help="steps per task in the chain scenario"),
) -> None:
    """Per-step checkpoint overhead vs a bare INSERT + COMMIT on the same Postgres.

    Timings and counts come from separate passes: counting writes (a hook on every statement)
    would slow the steps it measures.
    """
    os.environ["RATCHET_BROKER_URL"] = "memory://localhost/"  # enqueues cost nothing here
    from shared.queue import get_celery
    from shared.settings import get_settings
    from shared.store.db import get_engine, require_migrated

    get_settings.cache_clear()
    get_celery.cache_clear()
    engine = get_engine()
    if engine.dialect.name != "postgresql":
        raise typer.BadParameter("set RATCHET_DATABASE_URL to a PostgreSQL database")
    require_migrated()
    tenant_id = _bench_tenant()
    baseline, driver = Baseline(), DriverBaseline()
    both = (baseline, driver)
    try:
        for _ in range(10):  # warm up connections, caches and prepared statements
            _time_steps(_new_task(tenant_id, _DONE), 1, out=defaultdict(list), baselines=both)
        baseline.timings.clear()
        driver.timings.clear()
        final: dict[int, list[float]] = defaultdict(list)
        for _ in range(tasks):
            _time_steps(_new_task(tenant_id, _DONE), 1, out=final, baselines=both)
        first_baseline, first_driver = summary(baseline.timings), summary(driver.timings)
        baseline.timings.clear()
        chain: dict[int, list[float]] = defaultdict(list)
        for _ in range(chains):
            script = [*[_CALL] * (steps - 1), {"content": "done"}]
            _time_steps(_new_task(tenant_id, script), steps, out=chain, baselines=[baseline])
        second_baseline = summary(baseline.timings)
        meter = WriteMeter()
        meter.install(engine)
        for _ in range(20):
            _time_steps(
                _new_task(tenant_id, _DONE), 1, out=defaultdict(list), baselines=(), meter=meter
            )
        final_commits = meter.commits.pop("step1", 0) / 20
        final_bytes = meter.bytes.pop("step1", 0) / 20
        for _ in range(2):
            script = [*[_CALL] * (steps - 1), {"content": "done"}]
            task_id = _new_task(tenant_id, script)
            _time_steps(task_id, steps, out=defaultdict(list), baselines=(), meter=meter)
    finally:
        baseline.drop()
        driver.close()
        _cleanup(tenant_id)
    base = first_baseline
    no_tools = summary(final[1])
    tool_steps = summary([t for n, ts in chain.items() if n < steps for t in ts])
    per_step_bytes = {n: meter.bytes[f"step{n}"] / 2 for n in range(1, steps)}
    emit(
        "checkpoint",
        {
            "baseline_insert_commit_ms": base,
            "step_without_tools_ms": no_tools,
            "step_without_tools_ratio_p50": no_tools["p50"] / base["p50"],
            "step_without_tools_ratio_p99": no_tools["p99"] / base["p99"],
            "driver_insert_commit_ms": first_driver,
            "step_without_tools_ratio_p50_to_driver": no_tools["p50"] / first_driver["p50"],
            "step_without_tools_write_commits": final_commits,
            "step_without_tools_bytes": final_bytes,
            "baseline_during_chains_ms": second_baseline,
            "step_with_one_tool_call_ms": tool_steps,
            "step_with_one_tool_call_ratio_p50": tool_steps["p50"] / second_baseline["p50"],
            "step_with_one_tool_call_write_commits": sum(
                meter.commits[f"step{n}"] for n in range(1, steps)
            )
            / (2 * (steps - 1)),
            "bytes_written_step_1": per_step_bytes[1],
            f"bytes_written_step_{steps - 1}": per_step_bytes[steps - 1],
            "bytes_ratio_last_to_first": per_step_bytes[steps - 1] / per_step_bytes[1],
        },
    )


# --- limiter -----------------------------------------------------------------------------


KINDS = ("incr", "limiter", "limiter3")
SLICE_SECONDS = 0.25  # the kinds take turns in slices this long, so drift hits them alike


def _client_loop(
    redis_url: str, threads: int, seconds: float, start_at: float, results: Any
) -> None:
    import redis

    from shared.ratelimit.limiter import Bucket, RedisLimiter, Take

    client = redis.Redis.from_url(redis_url)
    limiter = RedisLimiter(client)
    scope = "bench"
    # "limiter": one requests bucket and the model's 429 block (the common case);
    # "limiter3": a model's requests and tokens buckets and a tenant bucket, and the block.
    one = [Take(Bucket(f"model:{scope}:requests", rate=1e12))]
    three = [
        *one,
        Take(Bucket(f"model:{scope}:tokens", rate=1e15), 500),
        Take(Bucket(f"tenant:{scope}:requests", rate=1e12)),
    ]
    key = "ratchet:bench:incr"
    ops: dict[str, Callable[[], object]] = {
        "incr": lambda: client.incr(key),
        "limiter": lambda: limiter.acquire(one, blocks=[scope]),
        "limiter3": lambda: limiter.acquire(three, blocks=[scope]),
    }
    latencies: list[dict[str, list[float]]] = [defaultdict(list) for _ in range(threads)]

    def run(index: int) -> None:
        while time.time() < start_at:
            time.sleep(0.001)
        deadline, mine = start_at + seconds, latencies[index]
        while (now := time.time()) < deadline:
            turn = int((now - start_at) / SLICE_SECONDS)
            kind, turn_ends = KINDS[turn % len(KINDS)], start_at + (turn + 1) * SLICE_SECONDS
            op, out = ops[kind], mine[kind]
            while time.time() < turn_ends:
                started = time.perf_counter()
                op()
                out.append((time.perf_counter() - started) * 1000)

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    results.put({kind: [x for lane in latencies for x in lane[kind]] for kind in KINDS})


def _measure(redis_url: str, clients: int, seconds: float) -> dict[str, dict[str, float]]:
    """Every kind at ``clients`` concurrent clients, taking turns in short slices."""
    processes = 1 if clients == 1 else 2
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    start_at = time.time() + 3.0
    procs = [
        context.Process(
            target=_client_loop,
            args=(redis_url, clients // processes, seconds, start_at, results),
        )
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    merged: dict[str, list[float]] = defaultdict(list)
    for _ in procs:
        for kind, values in results.get(timeout=seconds + 60).items():
            merged[kind] += values
    for proc in procs:
        proc.join()
    each = seconds / len(KINDS)  # the time each kind had
    return {
        kind: {"ops_per_s": len(merged[kind]) / each, **summary(merged[kind])} for kind in KINDS
    }


def _saturate(
    redis_url: str, rate_per_s: float, seconds: float, start_at: float, results: Any
) -> None:
    import redis

    from shared.ratelimit.limiter import Bucket, RedisLimiter, Take

    limiter = RedisLimiter(redis.Redis.from_url(redis_url))
    bucket = Bucket("bench:saturated", rate=rate_per_s * 60, period_s=60, capacity=10)
    admitted = [0] * 8

    def run(index: int) -> None:
        while time.time() < start_at:
            time.sleep(0.001)
        while time.time() < start_at + seconds:
            decision = limiter.acquire([Take(bucket)])
            if decision.allowed:
                admitted[index] += 1
            else:
                time.sleep(min(decision.retry_after_ms, 2) / 1000)

    pool = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    results.put(sum(admitted))


@app.command()
def limiter(
    seconds: float = typer.Option(15.0, help="seconds per concurrency level (all kinds)"),
    saturate_seconds: float = typer.Option(60.0, help="length of the saturated accuracy run"),
    rate: float = typer.Option(100.0, help="the saturated bucket's rate, per second"),
) -> None:
    """Limiter decisions/s and latency vs a bare Redis INCR; admitted vs configured rate."""
    import redis

    from shared.ratelimit.limiter import Bucket
    from shared.settings import get_settings

    url = get_settings().redis_url
    client = redis.Redis.from_url(url)
    client.delete(Bucket("bench:saturated", rate=1).key)
    levels: dict[str, Any] = {}
    for clients in (1, 16, 64):
        measured = _measure(url, clients, seconds)
        incr, decision, decision3 = (measured[kind] for kind in KINDS)
        levels[str(clients)] = {
            "incr": incr,
            "limiter": decision,
            "rate_ratio": decision["ops_per_s"] / incr["ops_per_s"],
            "limiter_three_buckets": decision3,
            "rate_ratio_three_buckets": decision3["ops_per_s"] / incr["ops_per_s"],
        }
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    start_at = time.time() + 3.0
    procs = [
        context.Process(target=_saturate, args=(url, rate, saturate_seconds, start_at, results))
        for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    admitted = sum(results.get(timeout=saturate_seconds + 60) for _ in procs)
    for proc in procs:
        proc.join()
    expected = 10 + rate * saturate_seconds  # burst + refill over the run
    emit(
        "limiter",
        {
            "concurrency": levels,
            "saturated": {
                "configured_per_s": rate,
                "seconds": saturate_seconds,
                "admitted": admitted,
                "expected": expected,
                "error_pct": 100 * (admitted - expected) / expected,
            },
        },
    )


# --- delivery ----------------------------------------------------------------------------


class _Receiver:
    """A local webhook receiver that notes when each task's terminal webhook arrived."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        received = self.received = {}  # type: dict[str, float]

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                arrived = time.time()
                payload = json.loads(body)
                received.setdefault(payload["data"]["id"], arrived)
                self.send_response(204)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def _stack(env: dict[str, str], *, concurrency: int) -> Iterator[str]:
    import subprocess
    import sys

    import httpx

    port = _free_port()
    command = [sys.executable, "-m", "ratchet"]
    procs = [
        subprocess.Popen(
            [*command, "api", "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [*command, "worker", "--concurrency", str(concurrency), "--loglevel", "WARNING"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        time.sleep(3)  # let the worker connect to the broker
        yield url
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


async def _watch_sse(
    url: str, key: str, ids: list[str], seen: dict[str, float], connected: dict[str, float]
) -> None:
    """Follow every task's event stream at once (one event loop, so 50 streams cost the
    bench little); note when each stream delivered its first event (it is connected) and
    when its terminal event arrived."""
    import asyncio

    import httpx

    terminal = ("event: task.succeeded", "event: task.failed", "event: task.cancelled")
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=len(ids) + 10)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as http:

        async def follow(task_id: str) -> None:
            async with http.stream("GET", f"/v1/tasks/{task_id}/events") as response:
                async for line in response.aiter_lines():
                    connected.setdefault(task_id, time.time())
                    if line in terminal:
                        seen[task_id] = time.time()
                        return

        await asyncio.gather(*(follow(task_id) for task_id in ids))


def _round(url: str, key: str, receiver: _Receiver, tasks: int) -> tuple[list[float], list[float]]:
    import asyncio

    import httpx

    headers = {"Authorization": f"Bearer {key}"}
    body = {
        "input": "benchmark",
        "model": "scripted",
        "model_options": {"script": [{"content": "done", "delay_ms": 500}]},
        "webhook": {"url": receiver.url, "events": ["task.succeeded"]},
    }
    sse_seen: dict[str, float] = {}
    connected: dict[str, float] = {}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        ids = [client.post("/v1/tasks", json=body).json()["id"] for _ in range(tasks)]
        asyncio.run(_watch_sse(url, key, ids, sse_seen, connected))
        deadline = time.time() + 30
        while time.time() < deadline and not all(i in receiver.received for i in ids):
            time.sleep(0.05)
        finished = {}
        for task_id in ids:
            task = client.get(f"/v1/tasks/{task_id}").json()
            finished[task_id] = datetime.fromisoformat(task["finished_at"]).timestamp()
    webhook = [(receiver.received[i] - finished[i]) * 1000 for i in ids if i in receiver.received]
    # A stream that was still connecting when its task ended measures the connection, not
    # the delivery of an event: only streams connected beforehand count.
    sse = [
        (sse_seen[i] - finished[i]) * 1000
        for i in ids
        if i in sse_seen and connected[i] < finished[i]
    ]
    return webhook, sse


def _bare_posts(receiver: _Receiver, samples: int) -> list[float]:
    """The baseline: one plain POST of a task-sized body to the same receiver, keep-alive."""
    import httpx

    timings = []
    with httpx.Client() as client:
        for i in range(samples):
            data = {"id": f"baseline-{i}", "result": "x" * 400}
            body = {"type": "task.succeeded", "timestamp": "", "data": data}
            started = time.perf_counter()
            client.post(receiver.url, json=body)
            timings.append((time.perf_counter() - started) * 1000)
    return timings


@app.command()
def delivery(
    rounds_single: int = typer.Option(30, help="rounds of one task"),
    rounds_batch: int = typer.Option(3, help="rounds of 50 concurrent tasks"),
    concurrency: int = typer.Option(2, help="worker processes (one per core is best)"),
) -> None:
    """Terminal commit → webhook received and → SSE event received, at 1 and 50 tasks."""
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import create_key, create_tenant

    require_migrated()
    receiver = _Receiver()
    env = dict(os.environ)
    env["RATCHET_WEBHOOK_ALLOWED_HOSTS"] = "127.0.0.1"
    env["RATCHET_QUEUE_NAME"] = f"bench-{uuid.uuid4().hex[:8]}"
    with transaction() as session:
        tenant = create_tenant(session, f"bench-{uuid.uuid4().hex[:8]}")
        key = create_key(session, tenant, ("tasks:read", "tasks:write"))
        tenant_id = tenant.id
    results: dict[str, Any] = {}
    baseline = summary(_bare_posts(receiver, 200))
    try:
        with _stack(env, concurrency=concurrency) as url:
            for label, tasks, rounds in (("1", 1, rounds_single), ("50", 50, rounds_batch)):
                webhook: list[float] = []
                sse: list[float] = []
                for _ in range(rounds):
                    got_webhook, got_sse = _round(url, key, receiver, tasks)
                    webhook += got_webhook
                    sse += got_sse
                results[label] = {
                    "webhook_ms": summary(webhook),
                    "sse_ms": summary(sse),
                    "expected": tasks * rounds,
                }
                results[label]["webhook_ratio_p50"] = (
                    results[label]["webhook_ms"]["p50"] / baseline["p50"]
                )
                results[label]["sse_ratio_p50"] = results[label]["sse_ms"]["p50"] / baseline["p50"]
    finally:
        receiver.server.shutdown()
        _cleanup(tenant_id)
    emit(
        "delivery",
        {
            "baseline_bare_post_ms": baseline,
            "concurrent_tasks": results,
            "target": "p50 <= 50 ms, p99 <= 250 ms",
        },
    )


# The load benchmarks register their commands on the app above.
from ratchet import bench_history, bench_load, bench_throughput  # noqa: E402

__all__ = ["app", "bench_history", "bench_load", "bench_throughput"]
