"""Pictures of benchmark curves, for the docs.

``python -m benchmarks.plots context CSV PNG`` draws the curves ``ratchet bench context --csv``
wrote: each policy's prompt tokens per step, and their running totals. ``ratchet bench context
--plot PNG`` draws them as it runs. Needs matplotlib (in the dev extra).
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# A curve's column prefix in the CSV, and how the picture names it.
CONTEXT_CURVES = {
    "off_large": "off (a window that holds it all)",
    "truncate_small": "truncate (the small window)",
    "summarize_small": "summarize (the small window)",
    "off_small": "off (the small window): context_length_exceeded",
}


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The CSV's rows, numbers as integers and empty cells as None."""
    with path.open(newline="") as handle:
        return [
            {key: int(value) if value else None for key, value in row.items()}
            for row in csv.DictReader(handle)
        ]


def plot_context(rows: Sequence[dict[str, Any]], png: Path) -> None:
    """Two panels against the step: the prompt each policy sent, and the running total."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file
    from matplotlib import pyplot

    figure, (prompts, totals) = pyplot.subplots(1, 2, figsize=(12, 4.5), dpi=110)
    for prefix, label in CONTEXT_CURVES.items():
        points = [
            (row["step"], row[f"{prefix}_prompt"], row[f"{prefix}_total"])
            for row in rows
            if row.get(f"{prefix}_prompt") is not None
        ]
        if not points:
            continue
        steps, sent, total = zip(*points, strict=True)
        prompts.plot(steps, sent, label=label)
        totals.plot(steps, [t / 1e6 for t in total], label=label)
    prompts.set(title="Prompt tokens sent at each step", xlabel="step", ylabel="tokens")
    totals.set(
        title="Prompt tokens sent so far", xlabel="step", ylabel="million tokens (cumulative)"
    )
    for axes in (prompts, totals):
        axes.grid(alpha=0.3)
    prompts.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(png)
    pyplot.close(figure)


def main(argv: Sequence[str]) -> int:
    if len(argv) != 3 or argv[0] != "context":
        print("usage: python -m benchmarks.plots context CSV PNG", file=sys.stderr)
        return 2
    plot_context(read_rows(Path(argv[1])), Path(argv[2]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
