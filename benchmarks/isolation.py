"""``ratchet bench isolation``: the CPU a tool call costs in a tool process against the same
tool on a thread of the worker.

Both arms call one tool (``benchmarks.isolation_tools``: it adds two integers), registered
twice: ``isolation="thread"`` and ``isolation="process"``. This process is the worker: the
tool processes are its children, and their CPU counts with its own. Two measures, each taking
the arms in turn, round after round, so both see the same machine:

- calls: ``workers.tool_runner.execute`` alone, ``--calls`` at a time: what isolation adds to
  one call (the frames, the pipes, the other process's share);
- steps (PostgreSQL: ``RATCHET_DATABASE_URL``, migrated): chains of ``--steps`` tool steps
  through the whole step (lease, model response, the ledger's rows, the commit) with the
  scripted model at 0 ms, as in ``ratchet bench mcp``.

Reported: CPU milliseconds per call (and per tool step) in each arm, this process and its
tool processes together, and the difference, which the isolation's target bounds (2 ms).
The tool processes' CPU is read from ``/proc`` in clock ticks, so it is summed over all
rounds rather than taken per round.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from benchmarks.harness.common import bench_tenant, drop_tenant, emit, host

TICKS = os.sysconf("SC_CLK_TCK")
TARGET_MS = 2.0


def _declare() -> None:
    """Load the benchmark's tool in this process and in its tool processes, before any
    settings are read."""
    modules = os.environ.get("RATCHET_AGENT_MODULES", "")
    named = [*filter(None, modules.split(",")), "benchmarks.isolation_tools"]
    os.environ["RATCHET_AGENT_MODULES"] = ",".join(dict.fromkeys(named))
    os.environ["RATCHET_BROKER_URL"] = "memory://localhost/"  # the steps run here
    # One tool process throughout: its start is measured on its own (``_start``).
    os.environ["RATCHET_TOOL_PROCESS_MAX_CALLS"] = str(10**9)


def _children_cpu() -> float:
    """CPU seconds of this process's live children (its tool processes)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            total += (int(fields[11]) + int(fields[12])) / TICKS
    return total


def _spent(work: Callable[[], None]) -> tuple[float, float]:
    """CPU seconds of this process, and of its children, while ``work`` runs."""
    cpu, children = time.process_time(), _children_cpu()
    work()
    return time.process_time() - cpu, _children_cpu() - children


def _start() -> float:
    """CPU seconds a tool process takes to start (and serve its first call), in a pool of
    its own."""
    from benchmarks.isolation_tools import PROCESS
    from workers.tool_processes.pool import fresh_pool

    with fresh_pool():
        return sum(_spent(lambda: _calls(PROCESS, 1)))


def _calls(name: str, count: int) -> None:
    from shared.agents.registry import ToolContext, get_registry
    from workers.tool_runner import execute

    tool = get_registry().tools[name]
    for number in range(count):
        context = ToolContext(
            task_id="bench", tenant_id="bench", call_id=str(number), idempotency_key="bench"
        )
        outcome = execute(tool, {"a": 20, "b": number}, context)
        if not outcome.ok or outcome.result != {"result": 20 + number}:
            raise typer.BadParameter(f"{name}: {outcome}")


def _chain(tenant_id: str, tool_name: str, steps: int) -> str:
    from shared.store.db import transaction
    from shared.store.tasks import NewTask, create_task

    turn = {"tool_calls": [{"name": tool_name, "arguments": {"a": 20, "b": 22}}]}
    spec = NewTask(
        agent="default",
        model="scripted",
        input="benchmark",
        instructions=None,
        tools=[tool_name],
        model_options={"script": [*[turn] * steps, {"content": "done"}]},
        max_steps=steps + 1,
        budget=None,
        webhook=None,
        metadata={},
    )
    with transaction() as session:
        return create_task(session, tenant_id, spec).task.id


def _steps(tenant_id: str, tool_name: str, steps: int) -> tuple[float, float]:
    from workers.steps.runner import advance

    task_id = _chain(tenant_id, tool_name, steps)

    def run() -> None:
        for step in range(1, steps + 1):
            advance(task_id, step)

    spent = _spent(run)
    advance(task_id, steps + 1)  # the final answer, not counted
    _check(task_id, steps)
    return spent


def _check(task_id: str, steps: int) -> None:
    from sqlalchemy import func, select

    from shared.store.db import transaction
    from shared.store.tables import Task, ToolCall

    with transaction() as session:
        status = session.scalar(select(Task.status).where(Task.id == task_id))
        ok = session.scalar(
            select(func.count()).where(ToolCall.task_id == task_id, ToolCall.status == "succeeded")
        )
    if status != "succeeded" or ok != steps:
        raise typer.BadParameter(f"task {task_id}: {status}, {ok} of {steps} calls succeeded")


def _per(spent: list[tuple[float, float]], count: int) -> dict[str, float]:
    """Milliseconds of CPU per unit: this process's, its tool processes', and both."""
    own = sum(s[0] for s in spent) / count * 1000
    children = sum(s[1] for s in spent) / count * 1000
    return {"worker": round(own, 3), "tool_processes": round(children, 3), "total": own + children}


def _arms(measure: Callable[[str], tuple[float, float]], rounds: int) -> dict[str, Any]:
    from benchmarks.isolation_tools import PROCESS, THREAD

    spent: dict[str, list[tuple[float, float]]] = {THREAD: [], PROCESS: []}
    for _ in range(rounds):
        for arm in (THREAD, PROCESS):
            spent[arm].append(measure(arm))
    return spent


def _report(spent: dict[str, list[tuple[float, float]]], count: int, unit: str) -> dict[str, Any]:
    from benchmarks.isolation_tools import PROCESS, THREAD

    thread, process = _per(spent[THREAD], count), _per(spent[PROCESS], count)
    more = process["total"] - thread["total"]
    return {
        f"thread_cpu_ms_per_{unit}": round(thread["total"], 3),
        f"process_cpu_ms_per_{unit}": round(process["total"], 3),
        f"process_worker_cpu_ms_per_{unit}": process["worker"],
        f"process_tool_process_cpu_ms_per_{unit}": process["tool_processes"],
        f"process_extra_cpu_ms_per_{unit}": round(more, 3),
        f"within_{TARGET_MS:g}_ms_target": more <= TARGET_MS,
    }


def isolation(
    *,
    calls: int = typer.Option(500, help="calls per round of the calls measure"),
    rounds: int = typer.Option(10, help="rounds of the calls measure, each arm in turn"),
    steps: int = typer.Option(20, help="tool steps per chain of the steps measure"),
    step_rounds: int = typer.Option(10, help="rounds of the steps measure (0: skip it)"),
) -> None:
    """CPU per tool call: in a tool process vs on a thread of the worker (same run)."""
    _declare()
    from benchmarks.isolation_tools import PROCESS, THREAD
    from shared.settings import Settings, get_settings

    get_settings.cache_clear()
    for arm in (THREAD, PROCESS):  # warm up: the call threads and the tool process start
        _calls(arm, 50)
    result: dict[str, Any] = {"host": host(), "calls_per_round": calls, "rounds": rounds}
    spent = _arms(lambda arm: _spent(lambda: _calls(arm, calls)), rounds)
    result["calls"] = _report(spent, calls * rounds, "call")
    start = min(_start() for _ in range(3))
    every = Settings.model_fields["tool_process_max_calls"].default
    result["tool_process_start_cpu_ms"] = round(start * 1000, 1)
    # A process serves RATCHET_TOOL_PROCESS_MAX_CALLS calls (by default) before its successor
    # starts: its start, shared out among them.
    result["start_cpu_ms_per_call_at_default_max_calls"] = round(start * 1000 / every, 3)
    if step_rounds:
        from shared.store.db import require_migrated

        require_migrated()
        tenant_id = bench_tenant()
        try:
            for arm in (THREAD, PROCESS):
                _steps(tenant_id, arm, 5)
            spent = _arms(lambda arm: _steps(tenant_id, arm, steps), step_rounds)
        finally:
            drop_tenant(tenant_id)
        result["steps"] = _report(spent, steps * step_rounds, "tool_step")
        result["steps"].update(steps_per_chain=steps, rounds=step_rounds)
    emit("isolation", result)
