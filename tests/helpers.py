"""Small builders shared by the tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

TERMINAL = ("succeeded", "failed", "cancelled")


def tool_turn(name: str, **arguments: Any) -> dict[str, Any]:
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


def calculator_script(steps: int = 3) -> list[dict[str, Any]]:
    """``steps - 1`` calculator calls, then a final answer: a task of exactly ``steps`` steps."""
    turns = [tool_turn("calculator", expression=f"{i}*7") for i in range(1, steps)]
    return [*turns, {"content": f"done after {steps - 1} calculations"}]


def scripted_task(script: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "input": "run the script",
        "model": "scripted",
        "model_options": {"script": script},
    } | extra


def admit() -> int:
    """Admit every task the dispatcher would (as its rounds do on a worker), sending their
    messages; returns how many. For tests that run no worker process."""
    from workers.dispatcher import Dispatcher

    dispatcher = Dispatcher()
    total = 0
    try:
        while dispatcher.lead():
            found = dispatcher.round()
            total += len(found.admitted)
            if not found.admitted:
                break
    finally:
        dispatcher.resign()
    return total


def bounded(call: Callable[[], Any], *, give_up: float = 30.0) -> tuple[Any, float]:
    """``call()``'s result (or the exception it raised) and how long it took; fails the test,
    rather than hang it, if it is still running after ``give_up`` seconds."""
    outcome: list[Any] = []
    started = time.monotonic()

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(give_up)
    assert outcome, f"the call was still running after {give_up:g} s"
    return outcome[0], time.monotonic() - started
