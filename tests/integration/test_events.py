"""The event stream (SSE) and the long poll, on PostgreSQL with Redis and on SQLite.

The API runs in-process; a task's steps are driven inline, from a background thread where a
reader must be waiting first. On PostgreSQL wake-ups travel through Redis as they do between
processes; on SQLite through the in-process listeners of ``ratchet dev``. Against real
``ratchet api`` and worker processes: ``tests/e2e/test_delivery.py``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.conftest import TenantHandle
from tests.helpers import calculator_script, scripted_task

pytestmark = pytest.mark.backends("postgresql", "sqlite")

PROBLEM_JSON = "application/problem+json"
STEPS = 3
# queued, started; per tool step: model response, tool call, completed; the final step's
# model response and completion, and the terminal event.
EXPECTED_TYPES = [
    "task.queued",
    "task.started",
    *["step.model_response", "step.tool_call", "step.completed"] * (STEPS - 1),
    "step.model_response",
    "step.completed",
    "task.succeeded",
]


@dataclass(frozen=True)
class Event:
    seq: int
    type: str
    data: dict[str, Any]


def parse_sse(text: str) -> list[Event]:
    """The committed events of an SSE body (``id``/``event``/``data`` fields, a blank line
    after each): live deltas, whose ids are ``<seq>.<pos>``, are left out."""
    events = []
    for block in text.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":")
        )
        if fields and "." not in fields["id"]:
            events.append(Event(int(fields["id"]), fields["event"], json.loads(fields["data"])))
    return events


def submit(client: TestClient, tenant: TenantHandle) -> str:
    response = client.post(
        "/v1/tasks", json=scripted_task(calculator_script(STEPS)), headers=tenant.headers
    )
    assert response.status_code == 202, response.text
    task_id: str = response.json()["id"]
    return task_id


def stream(
    client: TestClient, tenant: TenantHandle, task_id: str, **headers: str
) -> httpx.Response:
    return client.get(f"/v1/tasks/{task_id}/events", headers={**tenant.headers, **headers})


@contextmanager
def driven_later(drive: Callable[..., str], task_id: str, delay: float = 0.3) -> Iterator[None]:
    """Drive the task to its end from a background thread, once the caller is waiting."""
    failures: list[BaseException] = []

    def run() -> None:
        time.sleep(delay)
        try:
            drive(task_id)
        except BaseException as exc:  # surfaced in the test's thread below
            failures.append(exc)

    thread = threading.Thread(target=run, name="drive", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(timeout=30)
    if failures:
        raise failures[0]


@pytest.fixture
def finished(client: TestClient, tenant: TenantHandle, drive: Callable[..., str]) -> str:
    """A task that has run to its end."""
    task_id = submit(client, tenant)
    assert drive(task_id) == "succeeded"
    return task_id


# --- the event stream -------------------------------------------------------------------------


def test_a_finished_task_replays_every_event_in_order_and_the_stream_ends(
    client: TestClient, tenant: TenantHandle, finished: str
) -> None:
    response = stream(client, tenant, finished)

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    events = parse_sse(response.text)
    assert [e.type for e in events] == EXPECTED_TYPES
    assert [e.seq for e in events] == list(range(1, len(EXPECTED_TYPES) + 1))
    assert events[-1].data["id"] == finished
    assert events[-1].data["status"] == "succeeded"
    assert events[-1].data["result"] == {"output": f"done after {STEPS - 1} calculations"}
    assert response.text.endswith("\n\n")


def stored(task_id: str, type_: str) -> list[dict[str, Any]]:
    """What the log's rows of one type hold, in order (not what reads of the log give)."""
    from sqlalchemy import select

    from shared.store.db import transaction
    from shared.store.tables import TaskEvent

    with transaction() as session:
        return list(
            session.scalars(
                select(TaskEvent.data)
                .where(TaskEvent.task_id == task_id, TaskEvent.type == type_)
                .order_by(TaskEvent.seq)
            )
        )


def test_a_model_response_is_stored_as_its_step_and_read_whole(
    client: TestClient, tenant: TenantHandle, finished: str
) -> None:
    """The log's row names the step; the stream gives the answer, its calls' ids and usage
    from the step's checkpoint, exactly as the steps endpoint shows that step."""
    rows = stored(finished, "step.model_response")
    assert rows == [{"step": n} for n in range(1, STEPS + 1)]

    responses = [e.data for e in parse_sse(stream(client, tenant, finished).text)]
    responses = [d for d in responses if set(d) == {"step", "content", "tool_calls", "usage"}]
    steps = client.get(f"/v1/tasks/{finished}/steps", headers=tenant.headers).json()["items"]
    assert len(responses) == len(steps) == STEPS
    for data, step in zip(responses, steps, strict=True):
        assert data["step"] == step["number"]
        assert data["usage"] == step["usage"]
        assert data["usage"]["input_tokens"] > 0
        assert data["content"] == step["model"]["content"]
        calls = [{k: v for k, v in c.items() if k != "call_id"} for c in data["tool_calls"]]
        assert calls == step["model"]["tool_calls"]
        assert [c["call_id"] for c in data["tool_calls"]] == [
            c["call_id"] for c in step["tool_calls"]
        ]
    assert responses[0]["tool_calls"][0]["arguments"] == {"expression": "1*7"}
    assert responses[-1]["content"] == f"done after {STEPS - 1} calculations"


def test_a_calls_outcome_is_stored_as_its_call_and_read_whole(
    client: TestClient, tenant: TenantHandle, finished: str
) -> None:
    """The log's row names the call; the stream gives its outcome from the ledger's row."""
    rows = stored(finished, "step.tool_call")
    assert rows == [{"step": n, "call_id": f"{n}-0"} for n in range(1, STEPS)]

    outcomes = [e.data for e in parse_sse(stream(client, tenant, finished).text)]
    outcomes = [d for d in outcomes if "status" in d and "call_id" in d]
    assert outcomes == [
        {
            "step": n,
            "call_id": f"{n}-0",
            "name": "calculator",
            "status": "succeeded",
            "result": n * 7,
            "error": None,
        }
        for n in range(1, STEPS)
    ]


def test_a_live_stream_follows_the_task_to_its_terminal_event(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    task_id = submit(client, tenant)

    with driven_later(drive, task_id):
        response = stream(client, tenant, task_id)  # waits for the events as they commit

    assert [e.type for e in parse_sse(response.text)] == EXPECTED_TYPES


@pytest.mark.parametrize("resume", ["last-event-id", "after"])
def test_a_stream_resumes_after_the_event_it_names(
    client: TestClient, tenant: TenantHandle, finished: str, resume: str
) -> None:
    if resume == "last-event-id":
        response = stream(client, tenant, finished, **{"Last-Event-ID": "4"})
    else:
        response = client.get(
            f"/v1/tasks/{finished}/events", params={"after": 4}, headers=tenant.headers
        )

    events = parse_sse(response.text)
    assert [e.seq for e in events] == list(range(5, len(EXPECTED_TYPES) + 1))
    assert [e.type for e in events] == EXPECTED_TYPES[4:]


def test_resuming_after_the_terminal_event_ends_at_once(
    client: TestClient, tenant: TenantHandle, finished: str
) -> None:
    started = time.monotonic()
    response = stream(client, tenant, finished, **{"Last-Event-ID": str(len(EXPECTED_TYPES))})

    assert response.status_code == 200
    assert parse_sse(response.text) == []
    assert time.monotonic() - started < 1.0


def test_a_last_event_id_that_is_not_a_seq_is_422(
    client: TestClient, tenant: TenantHandle, finished: str
) -> None:
    response = stream(client, tenant, finished, **{"Last-Event-ID": "abc"})

    assert response.status_code == 422
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    assert [e["field"] for e in response.json()["errors"]] == ["Last-Event-ID"]


def test_another_tenants_task_is_404_and_nothing_streams(
    client: TestClient, make_tenant: Callable[..., TenantHandle], finished: str
) -> None:
    other = make_tenant()

    for task_id in (finished, "01a00000-0000-7000-8000-000000000000"):
        response = stream(client, other, task_id)
        assert response.status_code == 404
        assert response.headers["content-type"].startswith(PROBLEM_JSON)
        assert response.json()["status"] == 404


# --- the long poll ----------------------------------------------------------------------------


def test_a_long_poll_answers_as_soon_as_the_task_ends(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from api.routes import tasks as task_routes

    # No fallback poll within the wait: only the commit's wake-up can answer before it ends
    # (a bound a loaded machine meets, unlike a bound near the fallback's period).
    monkeypatch.setattr(task_routes, "FALLBACK_POLL_SECONDS", 3600.0)
    task_id = submit(client, tenant)

    with driven_later(drive, task_id, delay=0.5):
        started = time.monotonic()
        response = client.get(f"/v1/tasks/{task_id}", params={"wait": 30}, headers=tenant.headers)
        answered = time.monotonic()

    assert response.status_code == 200
    assert response.json()["status"] == "succeeded"
    assert 0.5 <= answered - started < 25  # woken by the commit, well before the wait ends


def test_a_long_poll_on_a_task_that_does_not_end_answers_at_the_timeout(
    client: TestClient, tenant: TenantHandle
) -> None:
    task_id = submit(client, tenant)  # no worker runs it

    started = time.monotonic()
    response = client.get(f"/v1/tasks/{task_id}", params={"wait": 0.5}, headers=tenant.headers)

    assert response.json()["status"] == "queued"
    assert 0.5 <= time.monotonic() - started < 2.0


@pytest.mark.parametrize("wait", ["61", "-1", "soon"])
def test_a_long_poll_past_a_minute_or_not_a_number_is_422(
    client: TestClient, tenant: TenantHandle, finished: str, wait: str
) -> None:
    response = client.get(f"/v1/tasks/{finished}", params={"wait": wait}, headers=tenant.headers)

    assert response.status_code == 422
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    assert [e["field"] for e in response.json()["errors"]] == ["wait"]
