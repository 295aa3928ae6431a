"""Structured logs and traces from real processes: with RATCHET_LOG_FORMAT=json every log line
of the API and of a worker (its prefork children included) is one JSON object, and a step's
lines say which task, step and lease they belong to; with RATCHET_TRACING a task's spans
leave the worker."""

from __future__ import annotations

import json
import re
import time
from typing import Any

from shared.observability import tracing
from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory
from tests.e2e.util import wait_all
from tests.helpers import calculator_script, scripted_task


def json_lines(text: str) -> list[dict[str, Any]]:
    """The log's lines that are log records (Celery prints its banner as plain text)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_json_logs_follow_a_task_through_its_steps(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    fleet = stack(workers=1, concurrency=2, env={"RATCHET_LOG_FORMAT": "json"})
    with fleet.client(headers=tenant.headers) as http:
        task_id = http.post("/v1/tasks", json=scripted_task(calculator_script(3))).json()["id"]
        [task] = wait_all(http, None, [task_id], timeout=60).values()
    assert task["status"] == "succeeded"

    worker = json_lines(fleet.log_text("worker-0"))
    steps = [r for r in worker if r.get("task_id") == task_id and r["logger"] == "ratchet.step"]
    assert [(r["step"], r["message"].split()[2]) for r in steps] == [
        (1, "committed"),
        (2, "committed"),
        (3, "finished"),
    ], steps
    assert all(r["lease_epoch"] >= 1 and r["level"] == "INFO" for r in steps), steps
    assert {"time", "level", "logger", "message"} <= set(worker[0])
    records = [line for line in fleet.log_text("worker-0").splitlines() if " INFO " in line]
    assert records == [], records  # no record escaped the JSON handler

    api = json_lines(fleet.log_text("api"))
    access = [r for r in api if r["logger"] == "uvicorn.access"]
    assert any(f"/v1/tasks/{task_id}" in r["message"] for r in access), api[-5:]


def test_spans_leave_a_real_worker(stack: StackFactory, tenant: TenantHandle) -> None:
    """RATCHET_TRACING=console: the worker's prefork children export their spans (the SDK's
    export thread survives the fork), the task's root span among them."""
    env = {"RATCHET_TRACING": "console", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    fleet = stack(workers=1, concurrency=2, env=env)
    with fleet.client(headers=tenant.headers) as http:
        task_id = http.post("/v1/tasks", json=scripted_task(calculator_script(2))).json()["id"]
        [task] = wait_all(http, None, [task_id], timeout=60).values()
    assert task["status"] == "succeeded"
    trace_id = f"0x{tracing.task_ids(task_id)[0]:032x}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        log = fleet.log_text("worker-0")
        if log.count(trace_id) >= 6:  # the task, 2 steps, 2 model calls, 1 tool call
            break
        time.sleep(0.2)
    names = re.findall(r'"name": "([^"]+)",\s*"context": \{\s*"trace_id": "' + trace_id, log)
    assert sorted(names) == sorted(
        [
            "ratchet.task",
            "ratchet.step 1",
            "ratchet.step 2",
            "chat scripted",
            "chat scripted",
            "execute_tool calculator",
        ]
    ), names
