"""What ``ratchet children`` prints: the task, then each task below it after its parent, in
the order they started, indented by depth, with status, agent and usage."""

from __future__ import annotations

from typing import Any, cast

from ratchet.cli_waits import tree_lines
from ratchet.client import Client


def task(task_id: str, agent: str, cost: float | None = 0.5) -> dict[str, Any]:
    usage = {"input_tokens": 1200, "output_tokens": 30, "cost_usd": cost}
    return {"id": task_id, "status": "succeeded", "agent": agent, "usage": usage}


class Family:
    """The children the API would list for each task (the client's ``children``)."""

    def __init__(self, below: dict[str, list[dict[str, Any]]]) -> None:
        self.below = below

    def children(self, task_id: str) -> list[dict[str, Any]]:
        return self.below.get(task_id, [])


def test_each_task_follows_its_parent_one_level_deeper() -> None:
    family = Family(
        {
            "root": [task("lead-1", "lead"), task("res-2", "researcher")],
            "lead-1": [task("res-1a", "researcher", cost=None), task("res-1b", "researcher")],
        }
    )

    lines = tree_lines(cast(Client, family), task("root", "lead"))

    assert [line.split()[0] for line in lines] == ["root", "lead-1", "res-1a", "res-1b", "res-2"]
    assert [len(line) - len(line.lstrip()) for line in lines] == [0, 2, 4, 4, 2]
    assert lines[1] == "  lead-1  succeeded         lead             1,200 in / 30 out, $0.5000"
    assert lines[2].endswith("1,200 in / 30 out, cost unknown")
