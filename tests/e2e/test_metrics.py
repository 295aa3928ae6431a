"""Prometheus metrics: the API's /metrics and a worker's, summed over its prefork children."""

from __future__ import annotations

import re
import socket

import httpx

from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory
from tests.e2e.util import wait_all
from tests.helpers import calculator_script, scripted_task


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = re.match(rf"{name}(\{{(.*)\}})? (\S+)$", line)
        if match is None:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


def test_api_and_worker_metrics(stack: StackFactory, tenant: TenantHandle) -> None:
    port = free_port()
    fleet = stack(workers=1, concurrency=2, env={"RATCHET_WORKER_METRICS_PORT": str(port)})
    with fleet.client(headers=tenant.headers) as http:
        ids = [
            http.post("/v1/tasks", json=scripted_task(calculator_script(3))).json()["id"]
            for _ in range(4)
        ]
        tasks = wait_all(http, None, ids, timeout=60)
        assert {t["status"] for t in tasks.values()} == {"succeeded"}
        api_metrics = http.get("/metrics").text
    assert sample(api_metrics, "ratchet_tasks_submitted_total") >= 4

    worker_metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    # Four tasks of three steps: twelve steps, eight of them committed and four finishing.
    assert sample(worker_metrics, "ratchet_steps_total", outcome="committed") >= 8
    assert sample(worker_metrics, "ratchet_steps_total", outcome="finished") >= 4
    assert sample(worker_metrics, "ratchet_tasks_finished_total", status="succeeded") >= 4
    assert (
        sample(worker_metrics, "ratchet_tool_calls_total", tool="calculator", status="succeeded")
        >= 8
    )
    assert sample(worker_metrics, "ratchet_model_calls_total", model="scripted", outcome="ok") >= 12
    assert sample(worker_metrics, "ratchet_limiter_decisions_total", decision="allowed") >= 12
    assert sample(worker_metrics, "ratchet_step_duration_seconds_count") >= 12
