"""``ratchet bench history``: does a step cost more as its task's history grows?

One task of ``--steps`` steps (a calculator call each, then a final answer) with the scripted
model answering at once, run in this process on the configured database, twice: its steps
going on in place, as a worker runs them (each step reads only its predecessor's rows and
carries the conversation over), and, as the baseline, a message per step (each step leases
the task afresh and rebuilds the conversation from every earlier step's rows). Reported: the
CPU time and wall time of the steps near the end against the same near the start; then,
from a third run in place with every write counted, the write commits and the bytes of WAL
of a tool step near the start and near the end.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import typer

from benchmarks.harness.common import (
    bench_tenant,
    drop_queue,
    drop_tenant,
    emit,
    libpq_url,
    new_task,
)
from shared.settings import get_settings

SAMPLE = 10  # steps averaged at each end


def _script(steps: int) -> list[dict[str, Any]]:
    call = {"tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]}
    return [call] * (steps - 1) + [{"content": "done"}]


# The steps each end is sampled from: from step 2 (step 1 leases), and the last ones but the
# answer.
EARLY, LATE = slice(1, 1 + SAMPLE), slice(-SAMPLE - 1, -1)


def _each_step(run: Callable[[], None], around: Callable[..., Any]) -> None:
    """Run ``run`` with every step going through ``around(original, *args, **kwargs)``."""
    from workers.steps import runner

    original = runner.advance_one
    runner.advance_one = lambda *args, **kwargs: around(original, *args, **kwargs)
    try:
        run()
    finally:
        runner.advance_one = original


def _timed_steps(run: Callable[[], None]) -> list[tuple[float, float]]:
    """(CPU, wall) seconds of every step ``run`` makes, in order."""
    timings: list[tuple[float, float]] = []

    def timed(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timings.append((time.thread_time() - cpu, time.perf_counter() - wall))

    _each_step(run, timed)
    return timings


def _ends(timings: list[tuple[float, float]]) -> dict[str, float]:
    """Median CPU and wall (ms) of the early steps (from step 2) and of the last ones."""
    early, late = timings[EARLY], timings[LATE]
    figures = {}
    for label, steps in (("early", early), ("late", late)):
        figures[f"{label}_cpu_ms"] = 1000 * statistics.median(c for c, _ in steps)
        figures[f"{label}_wall_ms"] = 1000 * statistics.median(w for _, w in steps)
    figures["cpu_ratio"] = figures["late_cpu_ms"] / figures["early_cpu_ms"]
    figures["wall_ratio"] = figures["late_wall_ms"] / figures["early_wall_ms"]
    return figures


def _in_place(task_id: str) -> None:
    from workers.steps import runner

    runner.advance(task_id, 1, go_on=lambda: True)


def _message_per_step(task_id: str, steps: int) -> None:
    from workers.steps import runner

    for number in range(1, steps + 1):
        runner.advance(task_id, number)


def _written_in_place(task_id: str) -> dict[str, float]:
    """The task's steps in place again, each step's write commits and WAL counted (hooks on
    every statement would slow the timed passes): medians near the start and near the end.
    The WAL is the server's (``pg_current_wal_insert_lsn``), so run it on a quiet database."""
    import psycopg

    from benchmarks.harness.meter import WriteMeter
    from shared.store.db import get_engine

    wal: list[int] = []
    query = "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint"
    with (
        WriteMeter().watching(get_engine()) as meter,
        psycopg.connect(libpq_url(), autocommit=True) as probe,
    ):

        def metered(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            (before,) = probe.execute(query).fetchone() or (0,)
            with meter.labelled(f"step{len(wal) + 1}"):
                try:
                    return original(*args, **kwargs)
                finally:
                    (after,) = probe.execute(query).fetchone() or (0,)
                    wal.append(int(after) - int(before))

        _each_step(lambda: _in_place(task_id), metered)
    commits = [meter.commits[f"step{n}"] for n in range(1, len(wal) + 1)]
    return {
        "early_wal_bytes": statistics.median(wal[EARLY]),
        "late_wal_bytes": statistics.median(wal[LATE]),
        "early_write_commits": statistics.median(commits[EARLY]),
        "late_write_commits": statistics.median(commits[LATE]),
    }


def history(
    *,
    steps: int = typer.Option(200, help="steps of the task (at most max_steps_limit)"),
) -> None:
    """The cost of a step near the end of a long task against one near its start."""
    from shared.store.db import require_migrated

    require_migrated()
    queue = f"bench-{uuid.uuid4().hex[:8]}"  # where the baseline's next-step messages go
    os.environ["RATCHET_QUEUE_NAME"] = queue
    get_settings.cache_clear()
    tenant_id = bench_tenant()
    try:
        carried = new_task(tenant_id, _script(steps))
        in_place = _timed_steps(lambda: _in_place(carried))
        rebuilt = new_task(tenant_id, _script(steps))
        baseline = _timed_steps(lambda: _message_per_step(rebuilt, steps))
        written = _written_in_place(new_task(tenant_id, _script(steps)))
    finally:
        drop_tenant(tenant_id)
        drop_queue(queue)
    emit(
        "history",
        {
            "steps": steps,
            "sampled_steps_each_end": SAMPLE,
            "in_place": _ends(in_place),
            "baseline_message_per_step": _ends(baseline),
            "in_place_writes_per_tool_step": written,
            "target": "a step near the end <= 1.2x the CPU and time of step 2; "
            "<= 2.5 KB of WAL and <= 3 write commits a tool step",
        },
    )
