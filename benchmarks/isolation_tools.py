"""The tool ``ratchet bench isolation`` calls, twice over: on a thread of the worker and in a
tool process. An agent module (``RATCHET_AGENT_MODULES``), as the tool processes import the
tools they run by name."""

from __future__ import annotations

from shared.agents.registry import tool

THREAD = "bench_add_thread"
PROCESS = "bench_add_process"


def add(a: int, b: int) -> dict[str, int]:
    """Add two integers."""
    return {"result": a + b}


tool(name=THREAD, idempotent=True, isolation="thread")(add)
tool(name=PROCESS, idempotent=True, isolation="process")(add)
