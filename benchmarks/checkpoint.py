"""``ratchet bench checkpoint``: the per-step cost of the checkpoint path.

A step (lease, model-response commit, tool ledger, step commit) with the scripted model at
0 ms, against a bare single-row INSERT + COMMIT on the same Postgres; commits per step; bytes
written per step by step number.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

from benchmarks.harness.common import bench_tenant, drop_tenant, emit, new_task, summary
from benchmarks.harness.meter import WriteMeter

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

_DONE: list[dict[str, Any]] = [{"content": "done"}]
_CALL: dict[str, Any] = {"tool_calls": [{"name": "calculator", "arguments": {"expression": "1+1"}}]}
WARM_UP = 10  # one-step tasks first, untimed: connections, caches and prepared statements
COUNTED_TASKS = 20  # one-step tasks whose writes are counted
COUNTED_CHAINS = 2  # chains whose writes are counted, step by step


def _chain_script(steps: int) -> list[dict[str, Any]]:
    """A tool call at every step but the last, which answers."""
    return [*[_CALL] * (steps - 1), {"content": "done"}]


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


def _time_steps(
    task_id: str,
    steps: int,
    *,
    out: dict[int, list[float]],
    baselines: Sequence[Baseline | DriverBaseline],
    meter: WriteMeter | None = None,
) -> None:
    """Run the task's steps, timing each; after each, one sample of every baseline."""
    from workers.steps.runner import advance

    for number in range(1, steps + 1):
        with meter.labelled(f"step{number}") if meter else nullcontext():
            started = time.perf_counter()
            advance(task_id, number)
            out[number].append((time.perf_counter() - started) * 1000)
        for baseline in baselines:
            baseline.sample()


def _run_tasks(
    tenant_id: str,
    *,
    count: int,
    steps: int,
    baselines: Sequence[Baseline | DriverBaseline] = (),
    meter: WriteMeter | None = None,
) -> dict[int, list[float]]:
    """Make and run ``count`` tasks of ``steps`` steps one after another; their step times
    by step number."""
    out: dict[int, list[float]] = defaultdict(list)
    script = _DONE if steps == 1 else _chain_script(steps)
    for _ in range(count):
        _time_steps(new_task(tenant_id, script), steps, out=out, baselines=baselines, meter=meter)
    return out


@dataclass
class Timings:
    """The timed passes: step times by step number, and the baselines sampled beside them."""

    baseline: dict[str, float]  # beside the one-step tasks
    driver: dict[str, float]
    one_step: dict[int, list[float]]
    chain_baseline: dict[str, float]
    chain: dict[int, list[float]]


def _time_passes(
    tenant_id: str,
    baseline: Baseline,
    *,
    driver: DriverBaseline,
    tasks: int,
    chains: int,
    steps: int,
) -> Timings:
    """After a warm-up, the one-step tasks with both baselines, then the chains with the
    engine's baseline alone."""
    both = (baseline, driver)
    _run_tasks(tenant_id, count=WARM_UP, steps=1, baselines=both)
    baseline.timings.clear()
    driver.timings.clear()
    one_step = _run_tasks(tenant_id, count=tasks, steps=1, baselines=both)
    first_baseline, first_driver = summary(baseline.timings), summary(driver.timings)
    baseline.timings.clear()
    chain = _run_tasks(tenant_id, count=chains, steps=steps, baselines=[baseline])
    return Timings(first_baseline, first_driver, one_step, summary(baseline.timings), chain)


@dataclass
class Writes:
    """The counted pass: writes of a one-step task, and the meter holding the chains'."""

    one_step_commits: float
    one_step_bytes: float
    meter: WriteMeter


def _count_writes(engine: Engine, tenant_id: str, *, steps: int) -> Writes:
    """Hook every statement (which would slow the steps the timed passes measure) and count
    the writes of one-step tasks, then of chains step by step."""
    with WriteMeter().watching(engine) as meter:
        _run_tasks(tenant_id, count=COUNTED_TASKS, steps=1, meter=meter)
        commits = meter.commits.pop("step1", 0) / COUNTED_TASKS
        written = meter.bytes.pop("step1", 0) / COUNTED_TASKS
        _run_tasks(tenant_id, count=COUNTED_CHAINS, steps=steps, meter=meter)
    return Writes(commits, written, meter)


def _report(timings: Timings, writes: Writes, *, steps: int) -> dict[str, Any]:
    """The figures, each step time also as a ratio to the baseline sampled beside it."""
    base, driver, meter = timings.baseline, timings.driver, writes.meter
    no_tools = summary(timings.one_step[1])
    tool_steps = summary([t for n, ts in timings.chain.items() if n < steps for t in ts])
    per_step_bytes = {n: meter.bytes[f"step{n}"] / COUNTED_CHAINS for n in range(1, steps)}
    tool_commits = sum(meter.commits[f"step{n}"] for n in range(1, steps))
    return {
        "baseline_insert_commit_ms": base,
        "step_without_tools_ms": no_tools,
        "step_without_tools_ratio_p50": no_tools["p50"] / base["p50"],
        "step_without_tools_ratio_p99": no_tools["p99"] / base["p99"],
        "driver_insert_commit_ms": driver,
        "step_without_tools_ratio_p50_to_driver": no_tools["p50"] / driver["p50"],
        "step_without_tools_write_commits": writes.one_step_commits,
        "step_without_tools_bytes": writes.one_step_bytes,
        "baseline_during_chains_ms": timings.chain_baseline,
        "step_with_one_tool_call_ms": tool_steps,
        "step_with_one_tool_call_ratio_p50": tool_steps["p50"] / timings.chain_baseline["p50"],
        "step_with_one_tool_call_write_commits": tool_commits / (COUNTED_CHAINS * (steps - 1)),
        "bytes_written_step_1": per_step_bytes[1],
        f"bytes_written_step_{steps - 1}": per_step_bytes[steps - 1],
        "bytes_ratio_last_to_first": per_step_bytes[steps - 1] / per_step_bytes[1],
    }


def _postgres_engine() -> Engine:
    """The configured engine, checked to be a migrated PostgreSQL, with an in-memory broker:
    the steps run here, so their enqueues need cost nothing."""
    os.environ["RATCHET_BROKER_URL"] = "memory://localhost/"
    from shared.queue import get_celery
    from shared.settings import get_settings
    from shared.store import backends
    from shared.store.db import get_engine, require_migrated

    get_settings.cache_clear()
    get_celery.cache_clear()
    engine = get_engine()
    if backends.backend_of(engine).name != "postgresql":
        raise typer.BadParameter("set RATCHET_DATABASE_URL to a PostgreSQL database")
    require_migrated()
    return engine


def checkpoint(
    *,
    tasks: int = typer.Option(300, help="one-step tasks (the no-tools scenario)"),
    chains: int = typer.Option(10, help="tasks in the chain scenario"),
    steps: int = typer.Option(50, help="steps per task in the chain scenario"),
) -> None:
    """Per-step checkpoint overhead vs a bare INSERT + COMMIT on the same Postgres.

    Timings and counts come from separate passes: counting writes (a hook on every statement)
    would slow the steps it measures.
    """
    engine = _postgres_engine()
    tenant_id = bench_tenant()
    baseline, driver = Baseline(), DriverBaseline()
    try:
        timings = _time_passes(
            tenant_id, baseline, driver=driver, tasks=tasks, chains=chains, steps=steps
        )
        writes = _count_writes(engine, tenant_id, steps=steps)
    finally:
        baseline.drop()
        driver.close()
        drop_tenant(tenant_id)
    emit("checkpoint", _report(timings, writes, steps=steps))
