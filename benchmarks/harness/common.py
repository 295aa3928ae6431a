"""What every benchmark shares: summaries of timings, the report, and throw-away tenants,
tasks and queues on the configured stores."""

from __future__ import annotations

import json
import os
import statistics
import uuid
from typing import Any

import typer

# The task the load benchmarks submit: an OpenAI-compatible model (the stub, or nothing when
# no worker runs) and a tool, so a worker's every step is a model call.
TASK_BODY: dict[str, Any] = {
    "input": "benchmark",
    "model": "openai:bench",
    "tools": ["calculator"],
    "max_steps": 10,
}


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
    """Print the result and keep it in ``bench-results/NAME.json``, where runs are compared."""
    os.makedirs("bench-results", exist_ok=True)
    path = os.path.join("bench-results", f"{name}.json")
    with open(path, "w") as handle:
        json.dump(result, handle, indent=2)
    typer.echo(json.dumps(result, indent=2))
    typer.echo(f"(written to {path})", err=True)


def host() -> dict[str, Any]:
    """The machine the figures come from, and how busy it already was."""
    return {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2)}


def libpq_url() -> str:
    """The configured database as psycopg takes it (no SQLAlchemy driver suffix)."""
    from sqlalchemy.engine import make_url

    from shared.settings import get_settings

    url = make_url(get_settings().effective_database_url).set(drivername="postgresql")
    return url.render_as_string(hide_password=False)


def bench_tenant() -> str:
    """A throw-away tenant for tasks made in process (:func:`drop_tenant` removes it)."""
    from shared.store.db import transaction
    from shared.store.tenants import create_tenant

    with transaction() as session:
        return create_tenant(session, f"bench-{uuid.uuid4().hex[:8]}").id


def bench_key(*, worker: bool = True) -> tuple[str, str]:
    """A throw-away tenant and a key that may submit and read (:func:`drop_tenant` removes
    both), once the database is known to be migrated and (for a benchmark that runs a
    ``worker``) holds no unfinished tasks."""
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import create_key, create_tenant

    require_migrated()
    if worker:
        require_no_backlog()
    with transaction() as session:
        tenant = create_tenant(session, f"bench-{uuid.uuid4().hex[:8]}")
        key = create_key(session, tenant, ("tasks:read", "tasks:write"))
        return tenant.id, key


def require_no_backlog() -> None:
    """Stop, with one line, if the database holds unfinished tasks: the benchmark's worker
    would admit and run them too (calling the stub model, taking its threads), and its
    figures would measure them."""
    from sqlalchemy import func, select

    from shared.statuses import RUNNABLE_STATUSES, in_order
    from shared.store.db import transaction
    from shared.store.tables import Task

    with transaction() as session:
        count = session.scalar(
            select(func.count()).where(Task.status.in_(in_order(RUNNABLE_STATUSES)))
        )
    if count:
        typer.echo(
            f"the database holds {count} queued or running tasks, which this benchmark's worker "
            "would run too: give it a database of its own (RATCHET_DATABASE_URL)",
            err=True,
        )
        raise typer.Exit(2)


def new_task(tenant_id: str, script: list[dict[str, Any]]) -> str:
    """A task of the scripted model that answers with ``script``, one entry per step."""
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
        return create_task(session, tenant_id, spec).task.id


def drop_tenant(tenant_id: str) -> None:
    """Delete a benchmark's tenant, and with it its keys and tasks."""
    from shared.store.db import transaction
    from shared.store.tables import Tenant

    with transaction() as session:
        tenant = session.get(Tenant, tenant_id)
        if tenant is not None:
            session.delete(tenant)


def drop_queue(name: str) -> None:
    """Delete the broker keys of a private queue (and its webhook queue): messages left
    behind would otherwise stay in Redis with nobody to take them."""
    import redis

    from shared.queue import redis_broker_url

    url = redis_broker_url()
    if url is None:
        return
    client = redis.Redis.from_url(url)
    keys = [*client.scan_iter(f"{name}*"), *client.scan_iter(f"_kombu.binding.{name}*")]
    if keys:
        client.delete(*keys)
