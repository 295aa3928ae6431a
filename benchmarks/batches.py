"""``ratchet bench batch``: the time to get N tasks accepted as one ``POST /v1/tasks/batch``
against N single ``POST /v1/tasks``, on the same ``ratchet api`` process in the same run.

The singles are sent two ways: one after another from one keep-alive client (what a script
that loops does), and from ``--clients`` concurrent clients (the best a client can do without
batches). No worker runs, so the tasks stay queued and only acceptance is measured; rounds
alternate the order of the three, and the figures are medians over the rounds. Server CPU is
read from ``/proc`` for the API process alone.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import typer

from benchmarks.harness.common import bench_key, drop_queue, drop_tenant, emit, host
from benchmarks.harness.processes import Child, cpu_seconds, free_port, process_tree, wait_ok

# A one-step task of the scripted model: what a batch of work items typically is.
ONE_STEP: dict[str, Any] = {
    "input": "benchmark",
    "model": "scripted",
    "model_options": {"script": [{"content": "done"}]},
}
TIMEOUT_SECONDS = 120.0


def _batch(client: httpx.Client, tasks: int) -> None:
    answer = client.post("/v1/tasks/batch", json={"tasks": [ONE_STEP] * tasks})
    answer.raise_for_status()
    assert answer.json()["task_count"] == tasks, answer.text


def _singles(client: httpx.Client, tasks: int) -> None:
    for _ in range(tasks):
        client.post("/v1/tasks", json=ONE_STEP).raise_for_status()


def _concurrent_singles(url: str, headers: dict[str, str], tasks: int, clients: int) -> None:
    shares = [tasks // clients + (1 if n < tasks % clients else 0) for n in range(clients)]

    def lane(share: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=TIMEOUT_SECONDS) as client:
            _singles(client, share)

    with ThreadPoolExecutor(clients) as pool:
        for done in [pool.submit(lane, share) for share in shares]:
            done.result()


def _timed(run: Any, server: Child) -> tuple[float, float]:
    """Wall seconds of ``run()``, and the server's CPU seconds meanwhile."""
    cpu_before = cpu_seconds(process_tree(server.pid))
    started = time.perf_counter()
    run()
    elapsed = time.perf_counter() - started
    return elapsed, cpu_seconds(process_tree(server.pid)) - cpu_before


def _measure(
    url: str, headers: dict[str, str], server: Child, *, tasks: int, clients: int, rounds: int
) -> dict[str, list[tuple[float, float]]]:
    runs: dict[str, list[tuple[float, float]]] = {"batch": [], "singles": [], "concurrent": []}
    with httpx.Client(base_url=url, headers=headers, timeout=TIMEOUT_SECONDS) as client:
        kinds = {
            "batch": lambda: _batch(client, tasks),
            "singles": lambda: _singles(client, tasks),
            "concurrent": lambda: _concurrent_singles(url, headers, tasks, clients),
        }
        # Warm up every path (imports, caches, pooled connections) before measuring.
        _batch(client, 10)
        _singles(client, 10)
        _concurrent_singles(url, headers, 2 * clients, clients)
        order = list(kinds)
        for round_ in range(rounds):
            for kind in order[round_ % 3 :] + order[: round_ % 3]:
                runs[kind].append(_timed(kinds[kind], server))
    return runs


def _figures(runs: list[tuple[float, float]], tasks: int) -> dict[str, Any]:
    seconds = statistics.median(wall for wall, _ in runs)
    cpu = statistics.median(cpu for _, cpu in runs)
    return {
        "seconds": round(seconds, 3),
        "tasks_per_s": round(tasks / seconds, 1),
        "server_cpu_ms_per_task": round(1000 * cpu / tasks, 3),
        "rounds": [round(wall, 3) for wall, _ in runs],
    }


def batch(
    *,
    tasks: int = typer.Option(1000, help="tasks per batch, and single POSTs to compare"),
    clients: int = typer.Option(16, help="concurrent clients for the concurrent singles"),
    rounds: int = typer.Option(3, help="rounds of each (the figures are their medians)"),
) -> None:
    """Accepting N tasks in one batch vs N single POSTs (one client, and concurrent)."""
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    # No worker: the tasks stay queued, and their messages stay put in a queue of their own.
    env = {**os.environ, "RATCHET_QUEUE_NAME": queue, "RATCHET_BATCH_MAX_TASKS": str(tasks)}
    tenant_id, key = bench_key(worker=False)
    machine = host()
    port = free_port()
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with Child("ratchet", "api", "--port", str(port), env=env) as server:
            wait_ok(f"http://127.0.0.1:{port}/readyz", server)
            runs = _measure(
                f"http://127.0.0.1:{port}",
                headers,
                server,
                tasks=tasks,
                clients=clients,
                rounds=rounds,
            )
    finally:
        drop_tenant(tenant_id)
        drop_queue(queue)
    one, singles, concurrent = (
        _figures(runs[k], tasks) for k in ("batch", "singles", "concurrent")
    )
    emit(
        "batch",
        {
            "tasks": tasks,
            "clients": clients,
            "batch": one,
            "singles": singles,
            "concurrent_singles": concurrent,
            "speedup_vs_singles": round(singles["seconds"] / one["seconds"], 1),
            "speedup_vs_concurrent_singles": round(concurrent["seconds"] / one["seconds"], 1),
            "cpu_ratio_vs_singles": round(
                singles["server_cpu_ms_per_task"] / max(one["server_cpu_ms_per_task"], 1e-6), 1
            ),
            "host": machine,
        },
    )
