"""``ratchet bench NAME``: the benchmarks' commands, which ``ratchet`` loads from here only
when one is run (a checkout's dev install; neither the wheel nor the image holds them)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from benchmarks import (
    batches,
    capacity,
    checkpoint,
    context,
    dashboard,
    delivery,
    fairness,
    history,
    isolation,
    latency,
    limiter,
    mcp,
    neighbours,
    parallel_tools,
    sandbox,
    streaming,
    submissions,
    throughput,
    waits,
    walk,
)

HELP = "Benchmarks (figures are ratios to a same-run baseline)."
# The checkout this package lives in: the one whose code the benchmarks measure.
CHECKOUT = Path(__file__).resolve().parents[1]

app = typer.Typer(no_args_is_help=True, add_completion=False, help=HELP)


@app.callback()
def _benchmark_settings() -> None:
    # The benchmarks drive tasks with the scripted model, in this process and in the API and
    # worker processes they start (which inherit this environment); production keeps it off.
    os.environ.setdefault("RATCHET_SCRIPTED_MODEL", "true")
    # The stub model, the bare endpoint, the chain's worker and the LangGraph peer are
    # modules of this package, run as processes of their own: they import it, and Ratchet,
    # from this checkout, as this process does.
    paths = [str(CHECKOUT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))


def run_neighbours(ctx: typer.Context) -> None:
    """A quiet tenant's task and webhook under hostile tenants, before and after a change.

    Its options: ``ratchet bench neighbours --help``."""
    neighbours.main(ctx.args, prog="ratchet bench neighbours")


app.command("checkpoint")(checkpoint.checkpoint)
app.command("limiter")(limiter.limiter)
app.command("delivery")(delivery.delivery)
app.command("capacity")(capacity.capacity)
app.command("api")(submissions.api)
app.command("batch")(batches.batch)
app.command("history")(history.history)
app.command("throughput")(throughput.throughput)
app.command("dashboard")(dashboard.dashboard)
app.command("fairness")(fairness.fairness)
app.command("mcp")(mcp.mcp)
app.command("isolation")(isolation.isolation)
app.command("walk")(walk.walk)
app.command("context")(context.context)
app.command("latency")(latency.latency)
app.command("stream")(streaming.stream)
app.command("waits")(waits.waits)
app.command("parallel-tools")(parallel_tools.parallel_tools)
app.command("sandbox")(sandbox.sandbox)
# It takes its own options (argparse, shared with `python -m benchmarks.neighbours`).
app.command(
    "neighbours",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)(run_neighbours)

__all__ = ["app"]
