"""The quiet tenant: one-step scripted tasks at a steady pace, each followed from its POST to
its terminal state (long polls) and to its webhook's arrival at a prompt receiver.

Every task is given ``limit`` seconds from its POST: one not terminal by then (or whose POST
failed) is counted as unfinished, its webhook as missing, and the load never waits longer
than the last task's limit.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.harness.common import percentile
from benchmarks.hostile import QuietReceiver

QUIET_SOURCE = "127.0.0.2"
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
LONG_POLL_SECONDS = 30.0
BODY: dict[str, Any] = {
    "input": "quiet",
    "model": "scripted",
    "model_options": {"script": [{"content": "done"}]},
    "tools": [],
    "max_steps": 2,
}


@dataclass
class Outcome:
    """One quiet task: when it was posted, and when the client saw it terminal
    (``time.monotonic()``)."""

    posted: float
    task_id: str | None = None
    finished: float | None = None
    status: str | None = None
    error: str | None = None


def follow(api: str, key: str, *, webhook: str, limit: float) -> Outcome:
    """POST one task and long-poll it until it is terminal or ``limit`` seconds have passed
    since the POST."""
    transport = httpx.HTTPTransport(local_address=QUIET_SOURCE)
    headers = {"Authorization": f"Bearer {key}"}
    outcome = Outcome(posted=time.monotonic())
    deadline = outcome.posted + limit
    with httpx.Client(base_url=api, headers=headers, transport=transport) as http:
        try:
            answer = http.post(
                "/v1/tasks", json=BODY | {"webhook": {"url": webhook}}, timeout=limit
            )
            if answer.status_code != 202:
                outcome.error = f"POST answered {answer.status_code}"
                return outcome
            outcome.task_id = answer.json()["id"]
            _long_poll(http, outcome, deadline=deadline)
        except httpx.HTTPError as exc:
            outcome.error = f"{type(exc).__name__}"
    return outcome


def _long_poll(http: httpx.Client, outcome: Outcome, *, deadline: float) -> None:
    while (left := deadline - time.monotonic()) > 0:
        wait = max(1, min(LONG_POLL_SECONDS, int(left)))
        answer = http.get(f"/v1/tasks/{outcome.task_id}", params={"wait": wait}, timeout=wait + 10)
        if answer.status_code != 200:
            outcome.error = f"GET answered {answer.status_code}"
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            continue
        status = answer.json()["status"]
        if status in TERMINAL:
            outcome.finished, outcome.status = time.monotonic(), status
            outcome.error = None
            return


def run(
    api: str, key: str, *, receiver: QuietReceiver, rate: float, seconds: float, limit: float
) -> list[Outcome]:
    """``rate`` tasks a second for ``seconds`` seconds, on a schedule (a late submission
    does not push the next ones back); the outcomes in submission order, once every task is
    terminal or past its limit and every webhook has arrived or is past its task's limit."""
    count = max(1, round(rate * seconds))
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=min(count, 256)) as pool:
        futures = []
        for index in range(count):
            time.sleep(max(0.0, start + index / rate - time.monotonic()))
            futures.append(pool.submit(follow, api, key, webhook=receiver.url, limit=limit))
        outcomes = [future.result() for future in futures]
    _await_webhooks(receiver, outcomes, limit=limit)
    return outcomes


def _await_webhooks(receiver: QuietReceiver, outcomes: list[Outcome], *, limit: float) -> None:
    waiting = [o for o in outcomes if o.task_id is not None]
    deadline = max((o.posted + limit for o in waiting), default=0.0)
    while time.monotonic() < deadline and any(o.task_id not in receiver.arrived for o in waiting):
        time.sleep(0.1)


def figures(values: list[float]) -> dict[str, float | int | None]:
    """Count, p50, p99 and max of ``values`` (seconds), rounded to the millisecond; the
    percentiles are None when there is nothing to take them of."""
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    return {
        "n": len(values),
        "p50": round(percentile(values, 50), 3),
        "p99": round(percentile(values, 99), 3),
        "max": round(max(values), 3),
    }


def report(outcomes: list[Outcome], arrived: dict[str, float], *, limit: float) -> dict[str, Any]:
    """What the quiet tenant saw: end-to-end seconds from POST to terminal state and from
    POST to webhook, of those that made it within ``limit``, and how many did not."""
    tasks = [o.finished - o.posted for o in outcomes if o.finished is not None]
    hooks = [
        arrived[o.task_id] - o.posted
        for o in outcomes
        if o.task_id in arrived and arrived[o.task_id] - o.posted <= limit
    ]
    errors = sorted({o.error for o in outcomes if o.error and o.finished is None})
    return {
        "submitted": len(outcomes),
        "task_s": figures(tasks),
        "unfinished_tasks": len(outcomes) - len(tasks),
        "not_succeeded": sum(1 for o in outcomes if o.status not in (None, "succeeded")),
        "webhook_s": figures(hooks),
        "missing_webhooks": len(outcomes) - len(hooks),
        "errors": errors[:5],
    }
