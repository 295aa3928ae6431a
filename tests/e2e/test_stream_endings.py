"""An event stream that cannot go on ends cleanly, with a last ``error`` event, instead of
being cut off mid-response: when the API process is told to stop (which no longer waits for
streams of tasks that do not finish), and when the database goes away under it."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.conftest import TenantHandle
from tests.e2e.conftest import Stack, StackFactory
from tests.e2e.util import DatabaseProxy
from tests.helpers import calculator_script, scripted_task

STREAMS = 3
EXIT_WITHIN_SECONDS = 15.0  # the default grace is 10 s; the streams themselves end at once


class Reader(threading.Thread):
    """Reads one task's event stream to its end, keeping each event's type and data."""

    def __init__(self, url: str, key: str, task_id: str) -> None:
        super().__init__(daemon=True)
        self.url, self.key, self.task_id = url, key, task_id
        self.events: list[tuple[str, str]] = []
        self.started = threading.Event()
        self.failure: Exception | None = None

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        path = f"{self.url}/v1/tasks/{self.task_id}/events"
        try:
            with httpx.stream("GET", path, headers=headers, timeout=90) as response:
                kind = ""
                for line in response.iter_lines():  # raises if the response is cut off
                    if line.startswith("event: "):
                        kind = line.removeprefix("event: ")
                    elif line.startswith("data: "):
                        self.events.append((kind, line.removeprefix("data: ")))
                        self.started.set()
        except httpx.HTTPError as exc:
            self.failure = exc
        finally:
            self.started.set()


def open_streams(fleet: Stack, tenant: TenantHandle, count: int) -> list[Reader]:
    with fleet.client(headers=tenant.headers) as http:  # no worker: it stays queued
        task_id = http.post("/v1/tasks", json=scripted_task(calculator_script())).json()["id"]
    readers = [Reader(fleet.url, tenant.key, task_id) for _ in range(count)]
    for reader in readers:
        reader.start()
    for reader in readers:
        assert reader.started.wait(30)
        assert reader.events[:1] == [("task.queued", reader.events[0][1])], reader.failure
    return readers


def last_problem(reader: Reader) -> dict[str, object]:
    """The stream ended whole, and its last event was an ``error`` with a problem."""
    reader.join(timeout=90)
    assert not reader.is_alive()
    assert reader.failure is None, repr(reader.failure)
    kind, data = reader.events[-1]
    assert kind == "error", reader.events
    problem: dict[str, object] = json.loads(data)
    assert problem["status"] == 503
    return problem


def test_a_stopping_api_ends_its_streams_and_exits(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    fleet = stack(workers=0)
    readers = open_streams(fleet, tenant, STREAMS)
    polled: list[httpx.Response] = []
    poll = threading.Thread(
        target=lambda: polled.append(
            httpx.get(
                f"{fleet.url}/v1/tasks/{readers[0].task_id}?wait=60",
                headers=tenant.headers,
                timeout=90,
            )
        ),
        daemon=True,
    )
    poll.start()
    time.sleep(1)  # the long poll is waiting (if not yet, it is answered at once all the same)
    assert fleet.api_proc is not None
    stopped_at = time.monotonic()
    fleet.api_proc.send_signal(signal.SIGTERM)
    fleet.api_proc.wait(timeout=EXIT_WITHIN_SECONDS)
    print(f"the API exited {time.monotonic() - stopped_at:.1f} s after SIGTERM")
    for reader in readers:
        assert last_problem(reader)["type"] == "urn:ratchet:problem:shutting-down"
    poll.join(timeout=30)
    # The long poll was answered with the task as it stood, not cut off by the grace's end.
    assert [(r.status_code, r.json()["status"]) for r in polled] == [(200, "queued")]


def test_a_stream_ends_with_an_error_event_when_the_database_goes_away(
    stack: StackFactory, database_proxy: DatabaseProxy, tenant: TenantHandle
) -> None:
    fleet = stack(workers=0, env=database_proxy.stack_env())
    (reader,) = open_streams(fleet, tenant, 1)
    database_proxy.go_silent()
    problem = last_problem(reader)
    assert problem["type"] == "urn:ratchet:problem:database-unavailable"
    assert "Traceback" not in fleet.log_text("api")
