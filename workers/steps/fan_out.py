"""The tool calls of one model answer, run at once: at most ``RATCHET_TOOL_CONCURRENCY`` of
them at a time, each through the ledger exactly as a call that runs alone
(``workers.steps.tools.run_tool_call``: its ``started`` row before it runs, its outcome
committed as it finishes). None of them commits the step's completion: the step completes
with a write of its own once every call is settled (``workers.steps.runner``).

The calls share the step: its context, whose writes take turns (``Context.writing``); its
cancel watch, log fields and span, which each call's thread reads from a copy of the step's
context variables; and its process's turns (``workers.step_pool``), one for each call while
it runs its own Python and writes, none while its tool works.
"""

from __future__ import annotations

import contextvars
import threading
from collections import deque

from shared import failpoints
from shared.settings import get_settings
from shared.store import ledger
from workers import step_pool
from workers.providers import ModelResponse
from workers.step_pool import Turns
from workers.steps import approval_waits, parking
from workers.steps.commits import TaskEnded
from workers.steps.context import Context
from workers.steps.tools import run_tool_call


def run_calls(
    ctx: Context, response: ModelResponse, positions: list[int]
) -> tuple[list[int], list[str]]:
    """Run the calls at ``positions`` at once and wait until all are settled; return the
    positions of those whose run ended with its outcome unknown and whose tool asks a person
    whether to run it again (``approval_waits.AskAgain``): the step then waits for them; and
    the ids of the calls parked on a wait (``parking.Parked``): the step then parks.

    A call that ends the task (a cancel, an unknown outcome that fails it) raises TaskEnded
    here, once: calls not started by then never start, and the outcomes of those still
    running are dropped (their rows stay ``started``, for the tool's unknown-outcome policy,
    as after a crash). Any other error of a call stops the calls not started too, and is
    raised once those running have settled.
    """
    stop = threading.Event()
    turns = step_pool.held()
    # Each call in a copy of the step's context variables, as taken here, on the step's thread.
    todo = deque((p, contextvars.copy_context()) for p in positions)
    errors: dict[int, BaseException] = {}

    def take_calls() -> None:
        while todo:
            try:
                position, context = todo.popleft()
            except IndexError:  # another thread took the last one
                return
            try:
                context.run(_run_call, ctx, response, position, turns, stop)
            except BaseException as exc:  # handed over to the step's thread
                errors[position] = exc

    # Daemon threads, as the step's own: a process that exits does not wait for them.
    threads = [
        threading.Thread(target=take_calls, name=f"fan-out-{n}", daemon=True)
        for n in range(min(len(positions), get_settings().tool_concurrency))
    ]
    # The step's thread waits without its turn: its calls take turns of their own.
    with step_pool.waiting():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return _settle(positions, errors)


def _run_call(
    ctx: Context,
    response: ModelResponse,
    position: int,
    turns: Turns | None,
    stop: threading.Event,
) -> None:
    with step_pool.turn_of(turns):
        if stop.is_set():
            return
        try:
            run_tool_call(ctx, position, response.tool_calls[position], last=False)
        except (approval_waits.AskAgain, parking.Parked):
            raise  # the others run on: the step waits for this one once they are settled
        except BaseException:
            stop.set()
            raise
        if ledger.call_id(ctx.lease.step, position) in ctx.outcomes:
            failpoints.hit("after_call_commit")


def _settle(positions: list[int], errors: dict[int, BaseException]) -> tuple[list[int], list[str]]:
    if any(isinstance(error, TaskEnded) for error in errors.values()):
        raise TaskEnded
    settled = (approval_waits.AskAgain, parking.Parked)
    for position in positions:
        error = errors.get(position)
        if error is not None and not isinstance(error, settled):
            raise error
    asked = [p for p in positions if isinstance(errors.get(p), approval_waits.AskAgain)]
    parked = [e.call_id for p in positions if isinstance(e := errors.get(p), parking.Parked)]
    return asked, parked
