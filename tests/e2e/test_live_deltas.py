"""Live token streaming against real processes (``ratchet api`` and ``ratchet worker`` on this
run's PostgreSQL and Redis): a worker killed mid-stream costs the reader nothing but the partial
answer, which it is told to drop before the re-run's deltas, and the deltas it keeps
concatenate to the committed answer."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx

from tests.conftest import TenantHandle
from tests.e2e.conftest import FAST_RECOVERY, StackFactory
from tests.helpers import scripted_task

ANSWER = " ".join(f"word{i}" for i in range(80)) + "."


class Reader:
    """An SSE reader on a thread of its own: every event of the task's stream, to its end,
    reconnecting with ``Last-Event-ID`` if the stream drops."""

    def __init__(self, url: str, tenant: TenantHandle, task_id: str) -> None:
        self.url, self.headers, self.task_id = url, dict(tenant.headers), task_id
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self.thread = threading.Thread(target=self._run, name="sse-reader", daemon=True)
        self.thread.start()

    def deltas(self) -> int:
        return sum(1 for _, kind, _ in list(self.events) if kind == "message.delta")

    def _run(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            headers = self.headers | ({"Last-Event-ID": self.events[-1][0]} if self.events else {})
            try:
                if self._read(headers):
                    return
            except httpx.HTTPError:
                time.sleep(0.2)

    def _read(self, headers: dict[str, str]) -> bool:
        path = f"{self.url}/v1/tasks/{self.task_id}/events"
        fields: dict[str, str] = {}
        with httpx.stream("GET", path, headers=headers, timeout=60) as response:
            for line in response.iter_lines():
                if line and not line.startswith(":"):
                    name, _, value = line.partition(": ")
                    fields[name] = value
                elif not line and "id" in fields:
                    self.events.append((fields["id"], fields["event"], json.loads(fields["data"])))
                    fields = {}
        return bool(self.events) and self.events[-1][1] == "task.succeeded"


def test_a_worker_killed_mid_stream_yields_a_discard_then_the_reruns_deltas(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    fleet = stack(workers=1, concurrency=1, env=FAST_RECOVERY)
    body = scripted_task([{"content": ANSWER, "delay_ms": 4000}])
    with fleet.client(headers=tenant.headers) as http:
        task_id = http.post("/v1/tasks", json=body).json()["id"]
    reader = Reader(fleet.url, tenant, task_id)
    deadline = time.monotonic() + 60
    while reader.deltas() < 5:
        assert time.monotonic() < deadline, "no deltas reached the reader"
        time.sleep(0.02)

    fleet.kill_worker(0)  # SIGKILL, mid-stream
    fleet.start_worker()  # its sweeper finds the dead lease and the step runs again
    reader.thread.join(timeout=120)

    kinds = [kind for _, kind, _ in reader.events]
    assert kinds[-1] == "task.succeeded"
    discards = [i for i, kind in enumerate(kinds) if kind == "message.discarded"]
    assert discards, f"no discard event: {kinds}"
    assert reader.events[discards[-1]][2] == {"step": 1, "reason": "rerun"}
    assert "message.delta" in kinds[: discards[0]]  # the partial answer it had
    kept = [data for _, kind, data in reader.events[discards[-1] :] if kind == "message.delta"]
    committed = next(data for _, kind, data in reader.events if kind == "step.model_response")
    assert "".join(d.get("text", "") for d in kept) == committed["content"] == ANSWER
    assert kinds.index("step.model_response") > discards[-1]
    ids = [event_id for event_id, _, _ in reader.events]
    assert len(ids) == len(set(ids))
