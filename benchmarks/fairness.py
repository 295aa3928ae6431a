"""``ratchet bench fairness``: a small tenant's tasks behind a big tenant's backlog.

Starts ``ratchet api`` and one ``ratchet worker`` with its defaults. Tenant A's ``--backlog``
one-step tasks are committed at once (straight into the database: the backlog is what is
measured, not A's submissions); a second later tenant B submits ``--small`` tasks over HTTP.
Reports B's start latency (submission to start) and time to finish, p50 and p99, and how much
of A's backlog was still waiting when B's last task ended — with fair scheduling on, then off
(``RATCHET_FAIR_SCHEDULING=false``: one FIFO), each on a fresh stack.
"""

from __future__ import annotations

import os
import time
import uuid
from contextlib import ExitStack
from typing import Any

import httpx
import typer

from benchmarks.harness.common import bench_key, drop_queue, drop_tenant, emit, percentile
from benchmarks.harness.processes import Child, free_port, wait_ok


def _commit_backlog(tenant_id: str, count: int) -> None:
    from shared.store.db import transaction
    from shared.store.tasks import NewTask, create_task

    spec = NewTask(
        agent="default",
        model="scripted",
        input="backlog",
        instructions=None,
        tools=[],
        model_options={"script": [{"content": "done"}]},
        max_steps=2,
        budget=None,
        webhook=None,
        metadata={},
    )
    with transaction() as session:
        for _ in range(count):
            create_task(session, tenant_id, spec)


def _times(ids: list[str]) -> list[tuple[Any, Any, Any, str]]:
    from sqlalchemy import select

    from shared.store.db import transaction
    from shared.store.tables import Task

    with transaction() as session:
        return [
            (r.created_at, r.started_at, r.finished_at, r.status)
            for r in session.execute(
                select(Task.created_at, Task.started_at, Task.finished_at, Task.status).where(
                    Task.id.in_(ids)
                )
            )
        ]


def _waiting(tenant_id: str) -> int:
    from sqlalchemy import func, select

    from shared.store.db import transaction
    from shared.store.tables import Task

    with transaction() as session:
        return int(
            session.scalar(
                select(func.count())
                .select_from(Task)
                .where(Task.tenant_id == tenant_id, Task.status.in_(("queued", "running")))
            )
            or 0
        )


def _run(*, fair: bool, backlog: int, small: int, timeout: float) -> dict[str, Any]:
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "RATCHET_QUEUE_NAME": queue, "RATCHET_FAIR_SCHEDULING": str(fair)}
    big_id, _ = bench_key()
    small_id, key = bench_key()
    try:
        with ExitStack() as stack:
            port = free_port()
            api = stack.enter_context(Child("ratchet", "api", "--port", str(port), env=env))
            stack.enter_context(Child("ratchet", "worker", "--loglevel", "WARNING", env=env))
            url = f"http://127.0.0.1:{port}"
            wait_ok(f"{url}/readyz", api)
            _commit_backlog(big_id, backlog)
            time.sleep(1.0)
            headers = {"Authorization": f"Bearer {key}"}
            body = {"input": "small", "model": "scripted", "tools": []}
            with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
                ids = [http.post("/v1/tasks", json=body).json()["id"] for _ in range(small)]
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    rows = _times(ids)
                    if all(r[3] in ("succeeded", "failed", "cancelled") for r in rows):
                        break
                    time.sleep(0.05)
            left = _waiting(big_id)
            rows = _times(ids)
    finally:
        drop_tenant(big_id)
        drop_tenant(small_id)
        drop_queue(queue)
    starts = [(s - c).total_seconds() for c, s, _, _ in rows if s is not None]
    ends = [(f - c).total_seconds() for c, _, f, _ in rows if f is not None]
    return {
        "fair_scheduling": fair,
        "small_finished": len(ends),
        "small_start_s": {"p50": percentile(starts, 50), "p99": percentile(starts, 99)},
        "small_finish_s": {"p50": percentile(ends, 50), "p99": percentile(ends, 99)},
        "big_backlog_left_when_small_done": left,
        "target": "every small task finished within 5 s of its submission",
        "met": len(ends) == small and max(ends, default=1e9) <= 5.0,
    }


def fairness(
    *,
    backlog: int = typer.Option(5000, help="tenant A's one-step tasks, committed at once"),
    small: int = typer.Option(20, help="tenant B's tasks, submitted a second later"),
    timeout: float = typer.Option(120.0, help="seconds to wait for B's tasks"),
) -> None:
    """A small tenant's start latency behind a big tenant's backlog, fair scheduling on/off."""
    runs = [
        _run(fair=fair, backlog=backlog, small=small, timeout=timeout) for fair in (True, False)
    ]
    emit("fairness", {"backlog": backlog, "small": small, "runs": runs})
