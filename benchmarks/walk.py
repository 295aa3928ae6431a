"""``ratchet bench walk``: the road a submission takes, from the POST route to its first
checkpoint (the model's answer committed), as a reader following it would walk it.

One task is submitted through the API (in process, on the configured database and Redis) and
its first step run in this process, as a worker would run it, with every call into Ratchet's
own code recorded until the checkpoint commits. A warm-up submission runs first, so imports
and first-use caches are not on the road. Reported: the product modules the road enters, how
often it moves from one module to another, and how often it crosses between ``api/``,
``shared/`` and ``workers/``.

The same file measures an older checkout: run it with that checkout first on ``PYTHONPATH``
(it uses only the route, the step runner and the ``after_model_commit`` failpoint).
"""

from __future__ import annotations

import itertools
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import typer

from benchmarks.harness.common import bench_key, drop_tenant, emit

PACKAGES = ("api", "shared", "workers")
SCRIPT = [
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]},
    {"content": "42"},
]


def _checkout() -> Path:
    """The checkout whose code runs: where the ``api`` package was imported from."""
    import api

    return Path(api.__file__).resolve().parents[1]


class Road:
    """The product modules entered, in order, until the first checkpoint commits."""

    def __init__(self, root: Path) -> None:
        self._prefix = f"{root}/"
        self.modules: list[str] = []
        self.arrived = False

    def __call__(self, frame: FrameType, event: str, _: Any) -> None:
        if event != "call" or self.arrived:
            return
        code = frame.f_code
        if code.co_name == "hit" and frame.f_locals.get("name") == "after_model_commit":
            self.arrived = True  # the model's answer has just committed
            return
        path = code.co_filename
        if path.startswith(self._prefix) and "/migrations/" not in path:
            module = path[len(self._prefix) :]
            if module.split("/", 1)[0] in PACKAGES:
                self.modules.append(module)


def _walk(client: Any, headers: dict[str, str], road: Road | None) -> None:
    from workers.steps.runner import advance

    body: dict[str, Any] = {"model": "scripted", "input": "walk", "tools": ["calculator"]}
    body["model_options"] = {"script": SCRIPT}
    if road is not None:
        sys.setprofile(road)
        threading.setprofile(road)
    try:
        answer = client.post("/v1/tasks", json=body, headers=headers)
        answer.raise_for_status()
        advance(answer.json()["id"], 1)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def walk() -> None:
    """Count the modules a submission passes through on its way to its first checkpoint."""
    from fastapi.testclient import TestClient

    from api.main import create_app

    tenant_id, key = bench_key(worker=False)
    headers = {"Authorization": f"Bearer {key}"}
    road = Road(_checkout())
    # Not entered as a context: each request then runs on an event loop (and threads) started
    # for it, after the recording began, so the API's part of the road is recorded too.
    client = TestClient(create_app())
    try:
        _walk(client, headers, None)  # imports and first-use caches off the road
        _walk(client, headers, road)
    finally:
        drop_tenant(tenant_id)
    if not road.arrived:
        typer.echo("the step never reached its first checkpoint", err=True)
        raise typer.Exit(1)
    stops = road.modules
    moves = list(itertools.pairwise(stops))
    emit(
        "walk",
        {
            "checkout": str(_checkout()),
            "modules": len(set(stops)),
            "moves_between_modules": sum(a != b for a, b in moves),
            "moves_between_packages": sum(a.split("/")[0] != b.split("/")[0] for a, b in moves),
            "by_package": {p: len({m for m in stops if m.startswith(p + "/")}) for p in PACKAGES},
            "road": sorted(set(stops)),
        },
    )
