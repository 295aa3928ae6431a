"""``ratchet bench delivery``: from a task's terminal commit to its webhook and its SSE event.

Starts ``ratchet api`` and a ``ratchet worker``, and times each terminal event's arrival at a
local webhook receiver and at an already connected SSE client, for 1 task at a time and for
50 at once, against a bare POST to the same receiver.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import typer

from benchmarks.harness.common import bench_key, drop_tenant, emit, summary
from benchmarks.harness.processes import Child, free_port, wait_ok

BATCH = 50  # tasks at once in the concurrent rounds
WORKER_CONNECT_SECONDS = 3.0


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


@contextmanager
def _stack(env: dict[str, str], *, concurrency: int) -> Iterator[str]:
    """``ratchet api`` and ``ratchet worker`` while the context lasts; yields the API's URL
    once it answers and the worker has had time to connect to the broker."""
    port = free_port()
    worker = ("worker", "--concurrency", str(concurrency), "--loglevel", "WARNING")
    with (
        Child("ratchet", "api", "--port", str(port), env=env) as api,
        Child("ratchet", *worker, env=env),
    ):
        url = f"http://127.0.0.1:{port}"
        wait_ok(f"{url}/readyz", api)
        time.sleep(WORKER_CONNECT_SECONDS)
        yield url


async def _watch_sse(
    url: str, key: str, *, ids: list[str], seen: dict[str, float], connected: dict[str, float]
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


def _round(
    url: str, key: str, *, receiver: _Receiver, tasks: int
) -> tuple[list[float], list[float]]:
    """Submit ``tasks`` tasks at once and follow them to the end: each one's delays (ms)
    from its terminal commit to its webhook and to its SSE event."""
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
        asyncio.run(_watch_sse(url, key, ids=ids, seen=sse_seen, connected=connected))
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


def _rounds(
    url: str, key: str, *, receiver: _Receiver, tasks: int, rounds: int, baseline: float
) -> dict[str, Any]:
    """``rounds`` rounds of ``tasks`` tasks: the delays, and their medians as ratios to the
    bare POST's median (``baseline``)."""
    webhook: list[float] = []
    sse: list[float] = []
    for _ in range(rounds):
        got_webhook, got_sse = _round(url, key, receiver=receiver, tasks=tasks)
        webhook += got_webhook
        sse += got_sse
    figures: dict[str, Any] = {
        "webhook_ms": summary(webhook),
        "sse_ms": summary(sse),
        "expected": tasks * rounds,
    }
    figures["webhook_ratio_p50"] = figures["webhook_ms"]["p50"] / baseline
    figures["sse_ratio_p50"] = figures["sse_ms"]["p50"] / baseline
    return figures


def delivery(
    *,
    rounds_single: int = typer.Option(30, help="rounds of one task"),
    rounds_batch: int = typer.Option(3, help="rounds of 50 concurrent tasks"),
    concurrency: int = typer.Option(2, help="worker processes (one per core is best)"),
) -> None:
    """Terminal commit → webhook received and → SSE event received, at 1 and 50 tasks."""
    tenant_id, key = bench_key()
    receiver = _Receiver()
    env = dict(os.environ)
    env["RATCHET_WEBHOOK_ALLOWED_HOSTS"] = "127.0.0.1"
    env["RATCHET_QUEUE_NAME"] = f"bench-{uuid.uuid4().hex[:8]}"
    results: dict[str, Any] = {}
    baseline = summary(_bare_posts(receiver, 200))
    try:
        with _stack(env, concurrency=concurrency) as url:
            for tasks, rounds in ((1, rounds_single), (BATCH, rounds_batch)):
                results[str(tasks)] = _rounds(
                    url,
                    key,
                    receiver=receiver,
                    tasks=tasks,
                    rounds=rounds,
                    baseline=baseline["p50"],
                )
    finally:
        receiver.server.shutdown()
        drop_tenant(tenant_id)
    emit(
        "delivery",
        {
            "baseline_bare_post_ms": baseline,
            "concurrent_tasks": results,
            "target": "p50 <= 50 ms, p99 <= 250 ms",
        },
    )
