"""``ratchet bench capacity`` and ``ratchet bench api``: the product's processes under load.

- ``capacity``: one ``ratchet api`` and one ``ratchet worker`` (its defaults, nothing tuned)
  against a model that answers after a fixed latency (:mod:`ratchet.llm_stub`). Hundreds of
  tasks are submitted at once; what counts is how many model calls the one worker host keeps
  in flight, measured by the provider, beside the Postgres connections and memory that cost.
- ``api``: submissions per second, latency and server CPU per submission of ``ratchet api``,
  against a bare FastAPI app that inserts one row per request (:mod:`ratchet.bench_bare`).

Every server runs as a subprocess of its own, so the CPU and memory read from ``/proc`` are
the server's alone.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import typer

from ratchet.bench import _cleanup, _free_port, app, emit, summary
from ratchet.bench_bare import libpq_url

if TYPE_CHECKING:
    import psycopg

TASK_BODY: dict[str, Any] = {
    "input": "benchmark",
    "model": "openai:bench",
    "tools": ["calculator"],
    "max_steps": 10,
}
# The limiter stays on (every call passes its buckets) but can never say "wait", whatever
# limits the environment configures for OpenAI models or for every tenant.
UNTHROTTLED = {
    "models": {
        model: {"requests": 1e12, "tokens": 1e15} for model in ("openai:*", TASK_BODY["model"])
    },
    "tenants": {"*": {"requests": 1e12, "tokens": 1e15, "submissions": 1e12}},
}
# Each sample walks /proc: sampled more often, the bench would load the host it measures.
SAMPLE_SECONDS = 0.5
STOP_SECONDS = 30.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Only this database's: other stacks (a test run, say) may share the server.
WORKER_CONNECTIONS = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE application_name LIKE 'ratchet-worker%' AND datname = current_database()"
)


# --- processes ---------------------------------------------------------------------------


class Child:
    """A subprocess in a process group of its own, its stderr kept in a temporary file so a
    failure to start can say why."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.name = " ".join(args[:2])
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, chars: int = 3000) -> str:
        self.log.seek(0, os.SEEK_END)
        self.log.seek(max(0, self.log.tell() - chars))
        return self.log.read().decode(errors="replace")

    def check(self) -> None:
        """Raise, with the end of its log, if the process has exited."""
        code = self.popen.poll()
        if code is not None:
            raise RuntimeError(f"{self.name} exited with {code}:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM (a graceful shutdown), then SIGKILL to its whole group if that is slow."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self.log.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def _wait_ok(url: str, child: Child, *, timeout: float = 60.0) -> None:
    """Poll ``url`` until it answers 200; fail at once if ``child`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        child.check()
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout} s:\n{child.tail()}")


def _drop_queue(name: str) -> None:
    """Delete the broker keys of a private queue (and its webhook queue): messages left
    behind would otherwise stay in Redis with nobody to take them."""
    import redis

    from shared.settings import get_settings

    url = get_settings().effective_broker_url
    if not url.startswith(("redis://", "rediss://")):
        return
    client = redis.Redis.from_url(url)
    keys = [*client.scan_iter(f"{name}*"), *client.scan_iter(f"_kombu.binding.{name}*")]
    if keys:
        client.delete(*keys)


def _host() -> dict[str, Any]:
    """The machine the figures come from, and how busy it already was."""
    return {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2)}


def _bench_key() -> tuple[str, str]:
    """A throw-away tenant and a key that may submit and read (``_cleanup`` removes both)."""
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import create_key, create_tenant

    require_migrated()
    with transaction() as session:
        tenant = create_tenant(session, f"bench-{uuid.uuid4().hex[:8]}")
        key = create_key(session, tenant, ("tasks:read", "tasks:write"))
        return tenant.id, key


# --- /proc -------------------------------------------------------------------------------


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _tree(root: int) -> list[int]:
    """``root`` and every live descendant (prefork children, their children)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, IndexError):
                continue  # exited while we looked
    found, pending = [], [root]
    while pending:
        pid = pending.pop()
        found.append(pid)
        pending += children.get(pid, [])
    return found


def _rss_mb(pids: Sequence[int]) -> float:
    total_kb = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
        except OSError:
            continue
    return total_kb / 1024


def _cpu_seconds(pids: Sequence[int]) -> float:
    """User + system time of these processes so far."""
    ticks = 0
    for pid in pids:
        try:
            fields = _stat(pid)
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / CLOCK_TICKS


def _pg_sockets(pids: Sequence[int], *, port: int) -> int:
    """Established TCP connections to ``port`` whose sockets these processes hold: the
    Postgres connections of a process tree, whatever application name they carry."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            links = [os.readlink(e.path) for e in os.scandir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    wanted = f":{port:04X}"
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            count += cols[2].endswith(wanted) and cols[3] == "01" and cols[9] in inodes
    return count


# --- capacity ----------------------------------------------------------------------------


class Sampler:
    """Every 0.5 s while tasks run: the calls the provider has in flight, the worker host's
    Postgres connections (by application name and by socket) and its resident memory."""

    def __init__(self, *, stub_url: str, worker_pid: int, pg_port: int) -> None:
        self.stub_url = stub_url
        self.worker_pid = worker_pid
        self.pg_port = pg_port
        self.series: dict[str, list[float]] = {
            "in_flight": [],
            "pg_by_name": [],
            "pg_by_socket": [],
            "rss_mb": [],
            "processes": [],
        }
        self.missed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import psycopg

        with (
            psycopg.connect(libpq_url(), autocommit=True, application_name="ratchet-bench") as db,
            httpx.Client(timeout=5) as http,
        ):
            while not self._stop.wait(SAMPLE_SECONDS):
                try:
                    self._sample(db, http)
                except (httpx.HTTPError, OSError, psycopg.Error):
                    self.missed += 1  # reported; one lost sample must not end the series

    def _sample(self, db: psycopg.Connection[Any], http: httpx.Client) -> None:
        pids = _tree(self.worker_pid)
        by_name = db.execute(WORKER_CONNECTIONS).fetchone()
        self.series["in_flight"].append(http.get(f"{self.stub_url}/stats").json()["in_flight"])
        self.series["pg_by_name"].append(by_name[0] if by_name else 0)
        self.series["pg_by_socket"].append(_pg_sockets(pids, port=self.pg_port))
        self.series["rss_mb"].append(_rss_mb(pids))
        self.series["processes"].append(len(pids))


@dataclass
class Submitted:
    """What the submitters did: task ids, when the first went out, and how it went."""

    started: float
    seconds: float = 0.0
    ids: list[str] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, ids: list[str], latencies_ms: list[float], errors: Counter[str]) -> None:
        with self._lock:
            self.ids += ids
            self.latencies_ms += latencies_ms
            self.errors.update(errors)


def _submit_lane(url: str, key: str, *, count: int, out: Submitted) -> None:
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
    out.add(ids, latencies, errors)


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
    from shared.store.tables import TaskStatus

    while True:
        statuses, last = _progress(ids)
        done = sum(statuses[s] for s in TaskStatus.TERMINAL)
        if done == len(ids) or time.time() >= deadline:
            return statuses, last
        time.sleep(0.5)


def _warm_up(url: str, key: str, *, worker: Child, timeout: float) -> None:
    """Run one task end to end. This is how the worker is known to be ready: Celery logs
    "ready." at INFO, below the WARNING the worker runs at; and the first task pays for the
    imports and connections no measured task should."""
    from shared.store.tables import TaskStatus

    submitted = _submit_all(url, key, tasks=1, submitters=1)
    if not submitted.ids:
        raise RuntimeError(f"the warm-up task was not accepted: {dict(submitted.errors)}")
    deadline = time.time() + timeout
    while time.time() < deadline:
        worker.check()
        statuses, _ = _progress(submitted.ids)
        if statuses[TaskStatus.SUCCEEDED]:
            return
        if any(statuses[s] for s in TaskStatus.TERMINAL):
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


def _pg_port() -> int:
    from sqlalchemy.engine import make_url

    return make_url(libpq_url()).port or 5432


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
    from shared.store.tables import TaskStatus

    scenario, submitted, stub = run.scenario, run.submitted, run.stub
    finished = sum(run.statuses[s] for s in TaskStatus.TERMINAL)
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
        **_pg_figures(run.series),
        "worker_rss_mb_max": round(max(run.series["rss_mb"], default=0.0), 1),
        "worker_processes_max": max(run.series["processes"], default=0),
        "samples": len(run.series["rss_mb"]),
        "missed_samples": run.missed_samples,
        "target": "wall <= 12 s, avg in flight >= 250, <= 20 PG connections, <= 1024 MB RSS",
        "host": run.host,
    }


def _measure_capacity(
    url: str, key: str, *, worker: Child, stub_url: str, scenario: Scenario
) -> CapacityRun:
    """Submit every task, sample while they run, wait until all are terminal (or the
    deadline), then read the provider's counters."""
    _warm_up(url, key, worker=worker, timeout=60 + 5 * scenario.ideal_s)
    httpx.post(f"{stub_url}/stats/reset")
    host = _host()
    sampler = Sampler(stub_url=stub_url, worker_pid=worker.pid, pg_port=_pg_port())
    with sampler:
        submitted = _submit_all(url, key, tasks=scenario.tasks, submitters=scenario.submitters)
        deadline = submitted.started + scenario.timeout_factor * scenario.ideal_s
        statuses, last = _wait_terminal(submitted.ids, deadline=deadline)
        stub = httpx.get(f"{stub_url}/stats").json()
    return CapacityRun(
        scenario=scenario,
        submitted=submitted,
        statuses=statuses,
        last_finished=last,
        deadline=deadline,
        stub=stub,
        series=sampler.series,
        missed_samples=sampler.missed,
        host=host,
    )


def _start_stack(
    stack: ExitStack, scenario: Scenario, *, env: dict[str, str]
) -> tuple[str, str, Child]:
    """The stub model, one API process and one worker with the product's defaults; returns
    the stub's URL, the API's URL and the worker once the first two answer."""
    stub_port, api_port = _free_port(), _free_port()
    env = {**env, "RATCHET_OPENAI_BASE_URL": f"http://127.0.0.1:{stub_port}/v1"}
    stub = stack.enter_context(
        Child(
            "ratchet.llm_stub",
            *("--port", str(stub_port), "--latency-ms", str(scenario.latency_ms)),
            *("--tool-steps", str(scenario.tool_steps)),
            env=env,
        )
    )
    api = stack.enter_context(Child("ratchet", "api", "--port", str(api_port), env=env))
    worker = stack.enter_context(Child("ratchet", "worker", "--loglevel", "WARNING", env=env))
    stub_url, api_url = f"http://127.0.0.1:{stub_port}", f"http://127.0.0.1:{api_port}"
    _wait_ok(f"{stub_url}/stats", stub)
    _wait_ok(f"{api_url}/readyz", api)
    return stub_url, api_url, worker


@app.command()
def capacity(
    tasks: int = typer.Option(500, help="tasks submitted at once"),
    latency_ms: int = typer.Option(2000, help="the stub model's latency per call"),
    tool_steps: int = typer.Option(2, help="tool calls before each task's final answer"),
    submitters: int = typer.Option(16, help="threads submitting over HTTP"),
    timeout_factor: float = typer.Option(20.0, help="give up after this many ideal times"),
) -> None:
    """Model calls in flight on one worker host (its defaults) against a slow model."""
    scenario = Scenario(tasks, latency_ms, tool_steps, submitters, timeout_factor)
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    env = _capacity_env(queue=queue)
    tenant_id, key = _bench_key()
    try:
        with ExitStack() as stack:
            stub_url, url, worker = _start_stack(stack, scenario, env=env)
            run = _measure_capacity(url, key, worker=worker, stub_url=stub_url, scenario=scenario)
    finally:
        _cleanup(tenant_id)
        _drop_queue(queue)
    emit("capacity", _capacity_report(run))


# --- api ---------------------------------------------------------------------------------


@dataclass
class Hammered:
    """Requests made against one target: latencies of the answered ones, statuses of all."""

    seconds: float
    latencies_ms: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    def add(self, latencies_ms: list[float], statuses: Counter[str]) -> None:
        with self._lock:
            self.latencies_ms += latencies_ms
            self.statuses.update(statuses)


def _hammer_lane(url: str, headers: dict[str, str], *, start_at: float, out: Hammered) -> None:
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    with httpx.Client(headers=headers, timeout=30) as client:
        while time.time() < start_at:
            time.sleep(0.001)
        while time.time() < start_at + out.seconds:
            started = time.perf_counter()
            try:
                status = str(client.post(url, json=TASK_BODY).status_code)
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1
                continue
            latencies.append((time.perf_counter() - started) * 1000)
            statuses[status] += 1
    out.add(latencies, statuses)


def _hammer(url: str, headers: dict[str, str], *, clients: int, seconds: float) -> Hammered:
    """POST the task body from ``clients`` threads, each with its own keep-alive client,
    all starting together, for ``seconds``."""
    out = Hammered(seconds=seconds)
    start_at = time.time() + 0.5  # every lane started and waiting
    with ThreadPoolExecutor(clients) as pool:
        lanes = [
            pool.submit(_hammer_lane, url, headers, start_at=start_at, out=out)
            for _ in range(clients)
        ]
        for lane in lanes:
            lane.result()
    return out


def _measure_target(
    url: str, headers: dict[str, str], *, server: Child, clients: int, seconds: float
) -> dict[str, Any]:
    """Warm the server up, then measure it: rate, latency, and its CPU per request."""
    _hammer(url, headers, clients=clients, seconds=2.0)
    cpu_before = _cpu_seconds(_tree(server.pid))
    hammered = _hammer(url, headers, clients=clients, seconds=seconds)
    cpu = _cpu_seconds(_tree(server.pid)) - cpu_before
    return {
        "submissions_per_s": round(hammered.statuses["202"] / seconds, 1),
        "latency_ms": summary(hammered.latencies_ms),
        "cpu_ms_per_submission": round(1000 * cpu / max(1, hammered.requests), 3),
        "requests": hammered.requests,
        "statuses": dict(hammered.statuses),
    }


@contextmanager
def _bare_table() -> Iterator[None]:
    import psycopg

    with psycopg.connect(libpq_url(), autocommit=True) as connection:
        connection.execute(
            "CREATE TABLE IF NOT EXISTS bench_bare (id uuid PRIMARY KEY, body jsonb NOT NULL,"
            " created_at timestamptz NOT NULL DEFAULT now())"
        )
        try:
            yield
        finally:
            connection.execute("DROP TABLE bench_bare")


@dataclass(frozen=True)
class Target:
    """A server to measure: how to start it on a port, where it is ready, what to POST to."""

    start: Callable[[int], Child]
    ready: str
    path: str
    headers: dict[str, str]


def _measure_server(target: Target, *, clients: int, seconds: float) -> dict[str, Any]:
    """Start the server, wait until it answers, measure it, stop it."""
    port = _free_port()
    with target.start(port) as server:
        _wait_ok(f"http://127.0.0.1:{port}{target.ready}", server)
        url = f"http://127.0.0.1:{port}{target.path}"
        return _measure_target(url, target.headers, server=server, clients=clients, seconds=seconds)


@app.command()
def api(
    seconds: float = typer.Option(15.0, help="measured seconds per target"),
    clients: int = typer.Option(16, help="concurrent keep-alive clients"),
) -> None:
    """POST /v1/tasks of one ``ratchet api`` process vs a bare FastAPI INSERT endpoint."""
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "RATCHET_QUEUE_NAME": queue}  # no worker: its messages stay put
    tenant_id, key = _bench_key()
    host = _host()
    ratchet = Target(
        lambda port: Child("ratchet", "api", "--port", str(port), env=env),
        ready="/readyz",
        path="/v1/tasks",
        headers={"Authorization": f"Bearer {key}"},
    )
    bare = Target(
        lambda port: Child(
            "uvicorn", "ratchet.bench_bare:create_app", "--factory", "--port", str(port), env=env
        ),
        ready="/openapi.json",
        path="/bare",
        headers={},
    )
    try:
        ours = _measure_server(ratchet, clients=clients, seconds=seconds)
        with _bare_table():
            baseline = _measure_server(bare, clients=clients, seconds=seconds)
    finally:
        _cleanup(tenant_id)
        _drop_queue(queue)
    emit("api", _api_report(ours, baseline, clients=clients, seconds=seconds, host=host))


def _api_report(
    ours: dict[str, Any],
    bare: dict[str, Any],
    *,
    clients: int,
    seconds: float,
    host: dict[str, Any],
) -> dict[str, Any]:
    return {
        "clients": clients,
        "seconds": seconds,
        "ratchet": ours,
        "bare": bare,
        "rate_ratio": round(ours["submissions_per_s"] / bare["submissions_per_s"], 2),
        "p50_ratio": round(ours["latency_ms"]["p50"] / bare["latency_ms"]["p50"], 2),
        "p99_ratio": round(ours["latency_ms"]["p99"] / bare["latency_ms"]["p99"], 2),
        "cpu_ratio": round(ours["cpu_ms_per_submission"] / bare["cpu_ms_per_submission"], 2),
        "target": "<= 4 ms CPU per submission, p99 <= 2x bare",
        "host": host,
    }
