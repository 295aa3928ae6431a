"""``ratchet bench parallel-tools``: a task whose model asks for several slow tool calls in one
answer, its calls one after the other (``RATCHET_TOOL_CONCURRENCY=1``, the baseline) and at
once (the default).

Each side starts ``ratchet api`` and one ``ratchet worker`` with its setting, then runs
``--tasks`` tasks one at a time: the scripted model asks for ``--calls`` calls of the ``sleep``
tool (``--seconds`` each) in its first answer, then answers. A task is timed end to end, from
its submission to a client long-polling ``GET /v1/tasks/{id}?wait=`` having its result; the
median of each side is reported, and the baseline's over the default's (how many times
faster the calls at once make the task).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import typer

from benchmarks.harness.common import bench_key, drop_queue, drop_tenant, emit, host, summary
from benchmarks.harness.processes import Child, free_port, wait_ok

WORKER_CONNECT_SECONDS = 3.0


@contextmanager
def _ratchet(env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    with (
        Child("ratchet", "api", "--port", str(port), env=env) as api,
        Child("ratchet", "worker", "--loglevel", "WARNING", env=env),
    ):
        url = f"http://127.0.0.1:{port}"
        wait_ok(f"{url}/readyz", api)
        time.sleep(WORKER_CONNECT_SECONDS)
        yield url


def _body(calls: int, seconds: float) -> dict[str, Any]:
    asked = [{"name": "sleep", "arguments": {"seconds": seconds}} for _ in range(calls)]
    script = [{"tool_calls": asked}, {"content": "slept"}]
    return {
        "input": "sleep a while, several times at once",
        "model": "scripted",
        "model_options": {"script": script},
        "tools": ["sleep"],
        "max_steps": 3,
    }


def _timed(url: str, key: str, body: dict[str, Any], *, tasks: int) -> list[float]:
    """Seconds from each submission to its result, one task at a time (one to warm up)."""
    seconds: list[float] = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as http:
        for number in range(-1, tasks):
            started = time.perf_counter()
            accepted = http.post("/v1/tasks", json=body, timeout=30)
            accepted.raise_for_status()
            task_id = accepted.json()["id"]
            task = http.get(f"/v1/tasks/{task_id}", params={"wait": 60}, timeout=90).json()
            finished = time.perf_counter()
            if task["status"] != "succeeded":
                raise RuntimeError(f"a benchmark task ended {task['status']}: {task['error']}")
            if number >= 0:
                seconds.append(finished - started)
    return seconds


def _side(concurrency: int | None, key: str, body: dict[str, Any], *, tasks: int) -> dict[str, Any]:
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "RATCHET_QUEUE_NAME": queue}
    if concurrency is None:
        env.pop("RATCHET_TOOL_CONCURRENCY", None)
    else:
        env["RATCHET_TOOL_CONCURRENCY"] = str(concurrency)
    try:
        with _ratchet(env) as url:
            seconds = _timed(url, key, body, tasks=tasks)
    finally:
        drop_queue(queue)
    from shared.settings import Settings

    default = Settings.model_fields["tool_concurrency"].default
    return {"tool_concurrency": concurrency or default, "task_s": summary(seconds)}


def parallel_tools(
    *,
    tasks: int = typer.Option(5, help="tasks timed on each side, one at a time"),
    calls: int = typer.Option(3, help="sleep calls the model asks for in one answer"),
    seconds: float = typer.Option(1.0, help="each call's sleep, in seconds"),
) -> None:
    """A task's calls of one answer one after the other, then at once: end-to-end time."""
    tenant_id, key = bench_key()
    body = _body(calls, seconds)
    try:
        baseline = _side(1, key, body, tasks=tasks)
        default = _side(None, key, body, tasks=tasks)
    finally:
        drop_tenant(tenant_id)
    one_by_one, at_once = baseline["task_s"]["p50"], default["task_s"]["p50"]
    emit(
        "parallel-tools",
        {
            "host": host(),
            "calls": calls,
            "seconds_per_call": seconds,
            "one_after_the_other": baseline,
            "at_once": default,
            "task_p50_one_after_the_other_over_at_once": round(one_by_one / at_once, 2),
            # What the calls at once add to the slowest of them: the fan-out, the commits.
            "at_once_over_one_call_s": round(at_once - seconds, 3),
        },
    )
