"""``ratchet bench sandbox``: what a run_python call costs in wall time.

A trivial program (``print(1)``) run again and again, the kinds taking turns: in bubblewrap's
namespaces, as the unsafe plain subprocess (both with the limits, through
``shared.sandbox.runs``), and as a bare ``python3 -I -c`` child, the baseline the ratios are to.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from benchmarks.harness.common import emit, host, summary

PROGRAM = "print(1)"


def _kinds(workspace: Path) -> dict[str, Callable[[], object]]:
    from shared.sandbox import runs, workspaces
    from shared.settings import get_settings

    settings = get_settings()
    limits = runs.Limits.from_settings(settings)
    python = shutil.which("python3", path=runs.SANDBOX_PATH)
    bwrap = shutil.which(settings.sandbox_bwrap)
    if python is None or bwrap is None:
        raise typer.BadParameter("the sandbox benchmark needs python3 and bwrap on this host")
    uid = workspaces.sandbox_uid(settings)
    launchers: dict[str, runs.Launcher] = {
        "bubblewrap": runs.Bubblewrap(bwrap, uid),
        "unsafe_subprocess": runs.UnsafeSubprocess(python, uid),
    }

    def sandboxed(launcher: runs.Launcher) -> Callable[[], object]:
        return lambda: runs.run(launcher, PROGRAM, workspace=workspace, limits=limits)

    kinds: dict[str, Callable[[], object]] = {
        "bare": lambda: subprocess.run(
            [python, "-I", "-c", PROGRAM], check=True, capture_output=True
        ),
    }
    kinds |= {name: sandboxed(launcher) for name, launcher in launchers.items()}
    return kinds


def sandbox(*, runs: int = typer.Option(50, help="runs of each kind, taking turns")) -> None:
    """Wall time of a trivial run_python run in bubblewrap and as a plain subprocess, vs a
    bare python3 child."""
    from shared.sandbox import workspaces

    top = Path(tempfile.mkdtemp(prefix="ratchet-bench-sandbox-", dir="/tmp"))
    top.chmod(0o711)
    os.environ["RATCHET_SANDBOX_DIR"] = str(top / "workspaces")
    try:
        workspace = workspaces.create(top / "workspaces" / "bench")
        kinds = _kinds(workspace)
        timings: dict[str, list[float]] = defaultdict(list)
        for _ in range(runs):
            for name, run in kinds.items():
                started = time.perf_counter()
                run()
                timings[name].append((time.perf_counter() - started) * 1000)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    result: dict[str, Any] = {"host": host(), "ms": {k: summary(v) for k, v in timings.items()}}
    bare = result["ms"]["bare"]["p50"]
    result["p50_ratio_to_bare"] = {k: v["p50"] / bare for k, v in result["ms"].items()}
    emit("sandbox", result)
