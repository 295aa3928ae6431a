"""Gates: hold a task at a known step until the test opens its gate.

A task of the ``gated`` agent whose script calls ``gate(label=…)`` (see :func:`gate_turn`)
stays ``running`` at that step, its tool call in flight, until the test opens the gate: no
test waits on how fast the machine is. The tool lives in :mod:`tests.browser.gated_agent`,
which only the stack's processes load (through RATCHET_AGENT_MODULES), so the test process's
own registry stays as the other tests expect it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.helpers import tool_turn

AGENT = "gated"
EXTENSION = "tests.browser.gated_agent"
GATES_ENV = "RATCHET_TEST_GATES"
ALL_OPEN = "all-open"  # opened when the stack stops, so no tool call outlives it


def gate_turn(label: str) -> dict[str, Any]:
    """A scripted model turn that calls ``gate`` and so waits for the gate ``label``."""
    return tool_turn("gate", label=label)


class Gates:
    """The test's side: the directory the ``gate`` tool watches."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def open(self, label: str) -> None:
        (self.root / label).touch()

    def open_all(self) -> None:
        self.open(ALL_OPEN)
