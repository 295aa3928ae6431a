"""``ratchet bench stream``: live token streaming, many streams at once on one worker host.

One ``ratchet api`` and one ``ratchet worker`` (their defaults) against the stub model
(:mod:`benchmarks.servers.llm_stub`) streaming each answer in ``--chunks`` pieces over
``--latency-ms``; ``--tasks`` one-call tasks are submitted at once to start ``--start-in``
seconds later, each by a reader that then follows its task's SSE stream (all on one asyncio
loop in this process), so every reader is listening when the calls begin. Each piece the stub
sends carries its send time, so
a reader knows, for every piece, how long it took from the stub's send to its own receipt:
through the worker's streaming call, the gathering of deltas, Redis, the API's stream and
the reader. Pieces sent before a reader asked for its stream are left out (they come from the
log, not live). It also checks that each stream's deltas concatenate to the committed answer.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
import typer

from benchmarks.capacity import (
    Scenario,
    _capacity_env,
    _cpu_now,
    _start_stack,
    _warm_up,
)
from benchmarks.harness.common import bench_key, drop_queue, drop_tenant, emit, host, summary

READER_CONNECTIONS = 1000


@dataclass
class Reading:
    """What the readers saw, all streams together."""

    latencies_ms: list[float] = field(default_factory=list)
    deltas: int = 0
    complete: int = 0  # streams whose deltas concatenate to the committed answer
    mismatched: int = 0
    late: int = 0  # readers connected only after the answer's commit: no deltas, rightly
    discarded: int = 0  # partial answers dropped (a call retried)
    unfinished: int = 0
    errors: dict[str, int] = field(default_factory=dict)


async def _read(client: httpx.AsyncClient, body: dict[str, Any], out: Reading) -> None:
    """Submit a task and follow its stream to the end: each live piece's latency, and whether
    the deltas add up to the committed answer."""
    submitted = await client.post("/v1/tasks", json=body)
    submitted.raise_for_status()
    task_id = submitted.json()["id"]
    text: list[str] = []
    fields: dict[str, str] = {}
    connected = time.time()  # a piece sent from now on is one the reader waits for
    async with client.stream("GET", f"/v1/tasks/{task_id}/events") as response:
        async for line in response.aiter_lines():
            if line and not line.startswith(":"):
                name, _, value = line.partition(": ")
                fields[name] = value
                continue
            if not line and fields:
                kind, data = fields.get("event"), fields.get("data", "{}")
                fields = {}
                if kind == "message.delta":
                    now, piece = time.time(), json.loads(data).get("text", "")
                    out.deltas += 1
                    text.append(piece)
                    marks = [float(mark) for mark in piece.split(";") if mark]
                    out.latencies_ms += [(now - m) * 1000 for m in marks if m >= connected]
                elif kind == "message.discarded":
                    out.discarded += 1
                    text = []
                elif kind == "step.model_response" and not text:
                    out.late += 1
                elif kind == "step.model_response":
                    same = json.loads(data).get("content") == "".join(text)
                    out.complete += same
                    out.mismatched += not same
                elif kind in ("task.succeeded", "task.failed"):
                    return
    out.unfinished += 1


async def _read_all(url: str, key: str, body: dict[str, Any], tasks: int, out: Reading) -> None:
    limits = httpx.Limits(max_connections=READER_CONNECTIONS)
    headers = {"Authorization": f"Bearer {key}"}
    timeout = httpx.Timeout(30.0, read=120.0)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, limits=limits, timeout=timeout
    ) as client:
        results = await asyncio.gather(
            *(_read(client, body, out) for _ in range(tasks)), return_exceptions=True
        )
    for result in results:
        if isinstance(result, BaseException):
            name = type(result).__name__
            out.errors[name] = out.errors.get(name, 0) + 1


def stream(
    *,
    tasks: int = typer.Option(300, help="tasks (and SSE readers) at once"),
    chunks: int = typer.Option(50, help="pieces the stub streams each answer in"),
    latency_ms: int = typer.Option(2000, help="the stub's time to stream an answer"),
    start_in: float = typer.Option(10.0, help="the tasks start this long after submission"),
    submitters: int = typer.Option(16, help="threads submitting the warm-up over HTTP"),
) -> None:
    """Live deltas of many streaming model calls at once: from the model's send to a reader."""
    scenario = Scenario(
        tasks=tasks,
        latency_ms=latency_ms,
        tool_steps=0,
        submitters=submitters,
        timeout_factor=30.0,
        chunks=chunks,
        stream=True,
    )
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    env = _capacity_env(queue=queue) | {
        "RATCHET_API_MAX_STREAMS": str(2 * READER_CONNECTIONS),
        "RATCHET_API_MAX_STREAMS_PER_TENANT": str(READER_CONNECTIONS),
        # Every reader comes from this one address, past the default cap of one client's.
        "RATCHET_API_MAX_CONNECTIONS_PER_CLIENT": str(2 * READER_CONNECTIONS),
    }
    tenant_id, key = bench_key()
    reading = Reading()
    try:
        with ExitStack() as stack:
            stub_url, url, (api, worker) = _start_stack(stack, scenario, env=env)
            _warm_up(url, key, worker=worker, timeout=60, body=scenario.body)
            httpx.post(f"{stub_url}/stats/reset")
            machine = host()
            cpu, started = _cpu_now(worker, api), time.time()
            body = scenario.body | {"delay_seconds": start_in}
            asyncio.run(_read_all(url, key, body, tasks, reading))
            wall = time.time() - started
            cpu = {name: value - cpu[name] for name, value in _cpu_now(worker, api).items()}
            stub = httpx.get(f"{stub_url}/stats").json()
    finally:
        drop_tenant(tenant_id)
        drop_queue(queue)
    emit("stream", _report(scenario, reading, stub=stub, cpu=cpu, wall=wall, machine=machine))


def _report(
    scenario: Scenario,
    reading: Reading,
    *,
    stub: dict[str, Any],
    cpu: dict[str, float],
    wall: float,
    machine: dict[str, Any],
) -> dict[str, Any]:
    calls = stub["calls"] or 1
    return {
        "streams": scenario.tasks,
        "chunks_per_answer": scenario.chunks,
        "answer_seconds": scenario.latency_s,
        "send_to_reader_ms": {k: round(v, 1) for k, v in summary(reading.latencies_ms).items()},
        "send_to_reader_ms_max": round(max(reading.latencies_ms, default=0.0), 1),
        "deltas_per_stream": round(reading.deltas / max(1, scenario.tasks), 1),
        "streams_complete": reading.complete,
        "streams_mismatched": reading.mismatched,
        "readers_connected_after_the_commit": reading.late,
        "partial_answers_discarded": reading.discarded,
        "streams_unfinished": reading.unfinished,
        "reader_errors": reading.errors,
        "peak_model_calls_in_flight": stub["peak"],
        "wall_seconds": round(wall, 2),
        "worker_cpu_ms_per_model_call": round(1000 * cpu["worker"] / calls, 2),
        "api_cpu_ms_per_stream": round(1000 * cpu["api"] / max(1, scenario.tasks), 2),
        "target": "every stream complete; p99 send to reader small beside the answer's time",
        "host": machine,
    }
