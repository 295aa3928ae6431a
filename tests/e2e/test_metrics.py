"""Prometheus metrics: the API's /metrics, summed over its processes, and a worker's, summed over
its prefork children."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory, free_port
from tests.e2e.util import wait_all
from tests.helpers import calculator_script, scripted_task

# What Prometheus scrapes the API with (RATCHET_METRICS_TOKEN); an operator's key works too.
TOKEN = "prometheus-scrape-token-0123456789abcdef"
SCRAPER = {"Authorization": f"Bearer {TOKEN}"}


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
    fleet = stack(
        workers=1,
        concurrency=2,
        env={"RATCHET_WORKER_METRICS_PORT": str(port), "RATCHET_METRICS_TOKEN": TOKEN},
    )
    with fleet.client(headers=tenant.headers) as http:
        ids = [
            http.post("/v1/tasks", json=scripted_task(calculator_script(3))).json()["id"]
            for _ in range(4)
        ]
        tasks = wait_all(http, None, ids, timeout=60)
        assert {t["status"] for t in tasks.values()} == {"succeeded"}
        assert http.get("/metrics").status_code == 403  # a tenant's key reads no fleet figures
        api_metrics = http.get("/metrics", headers=SCRAPER).text
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


def test_an_api_of_several_processes_serves_the_sum_of_their_metrics(
    stack: StackFactory, tenant: TenantHandle, tmp_path: Path
) -> None:
    directory = tmp_path / "api-metrics"
    fleet = stack(
        workers=0,
        api_workers=2,
        env={"PROMETHEUS_MULTIPROC_DIR": str(directory), "RATCHET_METRICS_TOKEN": TOKEN},
    )

    def writers() -> set[str]:  # the processes that have counted a submission
        return {f.stem.rsplit("_", 1)[-1] for f in directory.glob("counter_*.db")}

    submitted = 0
    # A new connection for each request: the kernel hands connections to either process.
    while submitted < 40 and (submitted < 6 or len(writers()) < 2):
        response = httpx.post(
            f"{fleet.url}/v1/tasks",
            json=scripted_task(calculator_script(2)),
            headers=tenant.headers,
            timeout=10,
        )
        assert response.status_code == 202, response.text
        submitted += 1
    assert len(writers()) == 2, "one process answered every request: nothing to add up"
    for _ in range(6):
        scraped = httpx.get(f"{fleet.url}/metrics", headers=SCRAPER, timeout=10).text
        assert sample(scraped, "ratchet_tasks_submitted_total") == submitted
