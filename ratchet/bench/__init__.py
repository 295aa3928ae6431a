"""``ratchet bench``: one module per benchmark, each reporting ratios to a baseline taken in
the same run; the processes they start, and the servers they measure against, beside them."""

from __future__ import annotations

import os

import typer

from ratchet.bench import (
    capacity,
    checkpoint,
    dashboard,
    delivery,
    fairness,
    history,
    limiter,
    submissions,
    throughput,
)

app = typer.Typer(
    no_args_is_help=True, help="Benchmarks (figures are ratios to a same-run baseline)."
)


@app.callback()
def _benchmark_settings() -> None:
    # The benchmarks drive tasks with the scripted model, in this process and in the API and
    # worker processes they start (which inherit this environment); production keeps it off.
    os.environ.setdefault("RATCHET_SCRIPTED_MODEL", "true")


app.command("checkpoint")(checkpoint.checkpoint)
app.command("limiter")(limiter.limiter)
app.command("delivery")(delivery.delivery)
app.command("capacity")(capacity.capacity)
app.command("api")(submissions.api)
app.command("history")(history.history)
app.command("throughput")(throughput.throughput)
app.command("dashboard")(dashboard.dashboard)
app.command("fairness")(fairness.fairness)

__all__ = ["app"]
