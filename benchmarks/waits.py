"""``ratchet bench waits``: tasks parked on durable waits for a long time hold nothing.

One ``ratchet api`` and one ``ratchet worker`` (their defaults). ``--tasks`` tasks of the
``default`` agent each ask the person a question (``ask_user``, a durable wait), so each
parks as ``waiting``. For ``--seconds`` the run samples, every ``--interval`` seconds, what
they hold — leases and concurrency slots (from the database), the worker's threads and memory
(from ``/proc``) — next to the same counts measured before any task was submitted. Then it
completes every wait by its signed URL (no API key) and times how long until all have
finished; a second completion of one must be refused (409).
"""

from __future__ import annotations

import time
import uuid
from contextlib import ExitStack
from typing import Any

import httpx
import typer

from benchmarks.capacity import _capacity_env
from benchmarks.harness.common import bench_key, drop_queue, drop_tenant, emit, host
from benchmarks.harness.processes import Child, free_port, process_tree, rss_mb, wait_ok

ASK = {
    "agent": "default",
    "model": "scripted",
    "input": "deploy it",
    "model_options": {
        "script": [
            {"tool_calls": [{"name": "ask_user", "arguments": {"question": "Which region?"}}]},
            {"content": "deployed"},
        ]
    },
}


def _threads(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as handle:
                for line in handle:
                    if line.startswith("Threads:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total


def _held(tenant_id: str) -> dict[str, int]:
    """What the tenant's tasks hold now, by status; leases and slots held."""
    from sqlalchemy import func, select

    from shared.store.db import transaction
    from shared.store.tables import Task

    with transaction() as session:
        rows = session.execute(
            select(Task.status, func.count())
            .where(Task.tenant_id == tenant_id)
            .group_by(Task.status)
        ).all()
        leases = session.scalar(
            select(func.count()).where(Task.tenant_id == tenant_id, Task.lease_owner.is_not(None))
        )
        slots = session.scalar(
            select(func.count()).where(
                Task.tenant_id == tenant_id,
                Task.admitted_ms.is_not(None),
                Task.status.in_(["queued", "running"]),
            )
        )
    return {
        **{str(s): int(n) for s, n in rows},
        "leases": int(leases or 0),
        "slots": int(slots or 0),
    }


def _worker_sample(worker: Child) -> dict[str, float]:
    pids = process_tree(worker.pid)
    return {"threads": _threads(pids), "rss_mb": round(rss_mb(pids), 1)}


def waits(
    tasks: int = typer.Option(50, min=1, max=5000, help="tasks parked on a wait"),
    seconds: float = typer.Option(600.0, min=1, help="how long they stay parked"),
    interval: float = typer.Option(30.0, min=1, help="seconds between samples"),
) -> None:
    """Tasks parked on durable waits for ``--seconds``: leases, slots, worker threads and
    memory while they wait, then every wait completed by its signed URL."""
    queue = f"bench-waits-{uuid.uuid4().hex[:8]}"
    api_port = free_port()
    env = {
        **_capacity_env(queue=queue),
        "RATCHET_SCRIPTED_MODEL": "true",
        "RATCHET_APPROVAL_LINK_SECRET": "bench-wait-links-" + "x" * 24,
        "RATCHET_PUBLIC_URL": f"http://127.0.0.1:{api_port}",
    }
    tenant_id, key = bench_key()
    result: dict[str, Any] = {"host": host(), "tasks": tasks, "seconds": seconds}
    try:
        with ExitStack() as stack:
            api = stack.enter_context(Child("ratchet", "api", "--port", str(api_port), env=env))
            worker = stack.enter_context(
                Child("ratchet", "worker", "--loglevel", "WARNING", env=env)
            )
            url = f"http://127.0.0.1:{api_port}"
            wait_ok(f"{url}/readyz", api)
            headers = {"Authorization": f"Bearer {key}"}
            with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
                time.sleep(3)  # the worker's start-up, before its baseline is taken
                result["worker_idle"] = _worker_sample(worker)
                ids = [http.post("/v1/tasks", json=ASK).json()["id"] for _ in range(tasks)]
                parked_at = _until(lambda: _held(tenant_id).get("waiting", 0) == tasks, worker)
                samples = []
                started = time.monotonic()
                while time.monotonic() - started < seconds:
                    samples.append(
                        {
                            "t_s": round(time.monotonic() - started),
                            **_held(tenant_id),
                            **_worker_sample(worker),
                        }
                    )
                    time.sleep(min(interval, max(0.0, seconds - (time.monotonic() - started))))
                samples.append(
                    {
                        "t_s": round(time.monotonic() - started),
                        **_held(tenant_id),
                        **_worker_sample(worker),
                    }
                )
                result["parked_in_s"] = round(parked_at, 2)
                result["while_parked"] = samples
                links = [
                    http.get(f"/v1/tasks/{i}").json()["waiting"]["waits"][0]["url"] for i in ids
                ]
                began = time.monotonic()
                with httpx.Client(timeout=30) as anyone:
                    codes = [anyone.post(link, json="eu-west-1").status_code for link in links]
                    again = anyone.post(links[0], json="us-east-1").status_code
                done_in = _until(lambda: _held(tenant_id).get("succeeded", 0) == tasks, worker)
                result["completions"] = {
                    "accepted": codes.count(200),
                    "second_completion_status": again,
                    "all_finished_in_s": round(done_in, 2),
                    "per_task_ms": round((time.monotonic() - began) * 1000 / tasks, 1),
                }
                result["after"] = {**_held(tenant_id), **_worker_sample(worker)}
    finally:
        drop_tenant(tenant_id)
        drop_queue(queue)
    emit("waits", result)


def _until(done: Any, worker: Child, timeout: float = 600.0) -> float:
    began = time.monotonic()
    while not done():
        worker.check()
        if time.monotonic() - began > timeout:
            raise RuntimeError(f"not done in {timeout} s:\n{worker.tail()}")
        time.sleep(0.2)
    return time.monotonic() - began
