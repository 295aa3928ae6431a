"""``ratchet bench mcp``: what a tool call costs when its tool lives behind an MCP server.

Chains of steps, one tool call each, run in this process through the whole step (lease, model
response, the ledger's rows, the step's commit) with the scripted model at 0 ms, on the
configured PostgreSQL. One arm calls a built-in Python tool, the other the same tool served
by a stdio MCP server (this module, run as ``python -m benchmarks.mcp``); both are idempotent
and return ``{"result": a + b}``. The arms take turns, round after round, so both see the same
machine. Reported: this process's CPU per tool step in each arm and their ratio, the MCP
server's own CPU per call, and how many times the server was started (once per process, not
per call).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import typer

from benchmarks.harness.common import bench_tenant, drop_tenant, emit, host

SERVER = "bench"
BUILTIN = "bench_add"
CHECKOUT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")


def _serve() -> None:
    """The MCP server of the benchmark, over stdio: one read-only tool."""
    from mcp.server import MCPServer
    from mcp.types import ToolAnnotations

    server = MCPServer(SERVER, log_level="CRITICAL")

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    server.run("stdio")


def _declare() -> None:
    """Declare the server and register the built-in twin of its tool, before any settings
    are read."""
    server = {"command": sys.executable, "args": ["-m", "benchmarks.mcp"], "cwd": str(CHECKOUT)}
    os.environ["RATCHET_MCP_SERVERS"] = json.dumps({SERVER: server})
    os.environ["RATCHET_BROKER_URL"] = "memory://localhost/"  # the steps run here

    from shared.agents.registry import tool

    @tool(name=BUILTIN, idempotent=True)
    def bench_add(a: int, b: int) -> dict[str, int]:
        """Add two integers."""
        return {"result": a + b}


def _chain(tenant_id: str, tool_name: str, calls: int) -> str:
    from shared.store.db import transaction
    from shared.store.tasks import NewTask, create_task

    turn = {"tool_calls": [{"name": tool_name, "arguments": {"a": 20, "b": 22}}]}
    script = [*[turn] * calls, {"content": "done"}]
    spec = NewTask(
        agent="default",
        model="scripted",
        input="benchmark",
        instructions=None,
        tools=[tool_name],
        model_options={"script": script},
        max_steps=calls + 1,
        budget=None,
        webhook=None,
        metadata={},
    )
    with transaction() as session:
        return create_task(session, tenant_id, spec).task.id


def _children_cpu() -> float:
    """CPU seconds of this process's live children (the stdio MCP server)."""
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


def _run(tenant_id: str, tool_name: str, calls: int) -> tuple[float, float]:
    """Run a chain of ``calls`` tool steps: this process's and its children's CPU seconds."""
    from workers.steps.runner import advance

    task_id = _chain(tenant_id, tool_name, calls)
    cpu, children = time.process_time(), _children_cpu()
    for step in range(1, calls + 1):
        advance(task_id, step)
    spent = time.process_time() - cpu, _children_cpu() - children
    advance(task_id, calls + 1)  # the final answer, not counted
    _check(task_id, calls)
    return spent


def _check(task_id: str, calls: int) -> None:
    from sqlalchemy import func, select

    from shared.store.db import transaction
    from shared.store.tables import Task, ToolCall

    with transaction() as session:
        status = session.scalar(select(Task.status).where(Task.id == task_id))
        ok = session.scalar(
            select(func.count()).where(ToolCall.task_id == task_id, ToolCall.status == "succeeded")
        )
    if status != "succeeded" or ok != calls:
        raise typer.BadParameter(f"task {task_id}: {status}, {ok} of {calls} calls succeeded")


def _report(cpu: dict[str, list[float]], server: list[float], *, calls: int) -> dict[str, Any]:
    from shared.mcp import connections

    per_call = {arm: statistics.median(values) / calls * 1000 for arm, values in cpu.items()}
    by_server = statistics.median(server) / calls * 1000
    return {
        "host": host(),
        "calls_per_round": calls,
        "rounds": len(server),
        "builtin_cpu_ms_per_tool_step": round(per_call[BUILTIN], 3),
        "mcp_cpu_ms_per_tool_step": round(per_call[SERVER], 3),
        "mcp_to_builtin_ratio": round(per_call[SERVER] / per_call[BUILTIN], 2),
        "mcp_server_cpu_ms_per_call": round(by_server, 3),
        "mcp_with_its_server_to_builtin_ratio": round(
            (per_call[SERVER] + by_server) / per_call[BUILTIN], 2
        ),
        "stdio_server_starts_in_this_process": connections.starts(SERVER),
    }


def mcp(
    *,
    calls: int = typer.Option(20, help="tool steps per chain"),
    rounds: int = typer.Option(20, help="rounds, each a chain of each arm in turn"),
) -> None:
    """CPU per tool step: an MCP tool (stdio) through the ledger vs a built-in Python tool."""
    _declare()
    from shared.settings import get_settings
    from shared.store.db import require_migrated

    get_settings.cache_clear()
    require_migrated()
    tenant_id = bench_tenant()
    cpu: dict[str, list[float]] = {BUILTIN: [], SERVER: []}
    server: list[float] = []
    try:
        for arm in (BUILTIN, f"{SERVER}.add"):  # warm up: the server starts, lists its tools
            _run(tenant_id, arm, 10)
        for _ in range(rounds):
            cpu[BUILTIN].append(_run(tenant_id, BUILTIN, calls)[0])
            spent, by_server = _run(tenant_id, f"{SERVER}.add", calls)
            cpu[SERVER].append(spent)
            server.append(by_server)
    finally:
        drop_tenant(tenant_id)
    emit("mcp", _report(cpu, server, calls=calls))


if __name__ == "__main__":
    _serve()
