"""``ratchet bench api``: submissions per second, latency and server CPU per submission.

``POST /v1/tasks`` to one ``ratchet api`` process (no worker: its messages stay queued),
against a bare FastAPI app that inserts one row per request (:mod:`benchmarks.servers.bare`),
measured the same way. Each server runs as a subprocess of its own, so the CPU read from
``/proc`` is the server's alone.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
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
    libpq_url,
    summary,
)
from benchmarks.harness.processes import Child, cpu_seconds, free_port, process_tree, wait_ok

WARM_UP_SECONDS = 2.0


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
    """One client: wait for the common start, then POST until the run's end, timing each
    answer; failures are counted, so the rate says what the server kept up with."""
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
    _hammer(url, headers, clients=clients, seconds=WARM_UP_SECONDS)
    cpu_before = cpu_seconds(process_tree(server.pid))
    hammered = _hammer(url, headers, clients=clients, seconds=seconds)
    cpu = cpu_seconds(process_tree(server.pid)) - cpu_before
    return {
        "submissions_per_s": round(hammered.statuses["202"] / seconds, 1),
        "latency_ms": summary(hammered.latencies_ms),
        "cpu_ms_per_submission": round(1000 * cpu / max(1, hammered.requests), 3),
        "requests": hammered.requests,
        "statuses": dict(hammered.statuses),
    }


@contextmanager
def _bare_table() -> Iterator[None]:
    """The bare server's table while the context lasts."""
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
    port = free_port()
    with target.start(port) as server:
        wait_ok(f"http://127.0.0.1:{port}{target.ready}", server)
        url = f"http://127.0.0.1:{port}{target.path}"
        return _measure_target(url, target.headers, server=server, clients=clients, seconds=seconds)


def _api_report(
    ours: dict[str, Any],
    bare: dict[str, Any],
    *,
    clients: int,
    seconds: float,
    host: dict[str, Any],
) -> dict[str, Any]:
    """Ratchet's figures beside the bare server's, as ratios, with the targets."""
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


def api(
    *,
    seconds: float = typer.Option(15.0, help="measured seconds per target"),
    clients: int = typer.Option(16, help="concurrent keep-alive clients"),
) -> None:
    """POST /v1/tasks of one ``ratchet api`` process vs a bare FastAPI INSERT endpoint."""
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    # No worker: its messages stay put. The model is never called, but it must be configured.
    env = {**os.environ, "RATCHET_QUEUE_NAME": queue, "RATCHET_OPENAI_API_KEY": "bench"}
    tenant_id, key = bench_key(worker=False)  # no worker: other tasks stay put
    machine = host()
    ratchet = Target(
        lambda port: Child("ratchet", "api", "--port", str(port), env=env),
        ready="/readyz",
        path="/v1/tasks",
        headers={"Authorization": f"Bearer {key}"},
    )
    bare = Target(
        lambda port: Child(
            "uvicorn",
            "benchmarks.servers.bare:create_app",
            "--factory",
            "--port",
            str(port),
            env=env,
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
        drop_tenant(tenant_id)
        drop_queue(queue)
    emit("api", _api_report(ours, baseline, clients=clients, seconds=seconds, host=machine))
