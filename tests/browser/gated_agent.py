"""The ``gated`` agent and its ``gate`` tool (see :mod:`tests.browser.gates`): loaded by the
browser tests' stack through RATCHET_AGENT_MODULES, never by the test process."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ratchet import Agent, ToolContext, register_agent, tool
from tests.browser.gates import AGENT, ALL_OPEN, GATES_ENV

LIMIT_SECONDS = 120.0
POLL_SECONDS = 0.05


@tool(timeout=LIMIT_SECONDS)
def gate(label: str, context: ToolContext) -> str:
    """Wait until the gate ``label`` is opened (or the task is cancelled)."""
    root = Path(os.environ[GATES_ENV])
    deadline = time.monotonic() + LIMIT_SECONDS
    while not ((root / label).exists() or (root / ALL_OPEN).exists()):
        if context.cancelled.wait(POLL_SECONDS) or time.monotonic() > deadline:
            return f"gate {label} abandoned"
    return f"gate {label} opened"


register_agent(Agent(name=AGENT, description="Waits at the test's gates.", tools=("gate",)))
