"""Live token streaming (DESIGN §6 "Live deltas"), on each backend: the run's PostgreSQL with
the Redis transport, and SQLite with the in-process one of ``ratchet dev``.

The API runs under a real uvicorn in this process and the task's steps run inline on a thread
of it, so an SSE reader reads real sockets while the model call streams from the
OpenAI-compatible test server. What is asserted is order and completeness (deltas before their
commit, concatenating to it, nothing lost or twice on a resume), never a latency.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.conftest import Configure, TenantHandle
from tests.fakes.openai_server import OpenAIServer, answer, tool_call
from tests.integration.test_events import driven_later

pytestmark = pytest.mark.backends("postgresql", "sqlite")

MODEL = "openai:gpt-4o-mini"
ANSWER = " ".join(f"word{i}" for i in range(100)) + "."


@dataclass(frozen=True)
class Seen:
    id: str
    type: str
    data: dict[str, Any]
    at: float  # time.time() when the reader had it


@pytest.fixture
def fake(openai_provider: OpenAIServer) -> OpenAIServer:
    return openai_provider


def submit(url: str, tenant: TenantHandle, **body: Any) -> str:
    sent = {"input": "Say a hundred words.", "model": MODEL, "tools": ["calculator"]} | body
    response = httpx.post(f"{url}/v1/tasks", json=sent, headers=tenant.headers)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def read(
    url: str,
    tenant: TenantHandle,
    task_id: str,
    *,
    last_event_id: str | None = None,
    until: Callable[[list[Seen]], bool] = lambda seen: False,
    path: str = "/v1/tasks/{}/events",
) -> list[Seen]:
    """The task's SSE events as they come (or those of ``path``, a thread's), to the stream's
    end or until ``until(seen)``."""
    headers = dict(tenant.headers) | ({"Last-Event-ID": last_event_id} if last_event_id else {})
    seen: list[Seen] = []
    fields: dict[str, str] = {}
    with httpx.stream("GET", url + path.format(task_id), headers=headers, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                if not line.startswith(":"):
                    name, _, value = line.partition(": ")
                    fields[name] = value
                continue
            if "id" in fields:
                seen.append(
                    Seen(fields["id"], fields["event"], json.loads(fields["data"]), time.time())
                )
                if until(seen):
                    return seen
            fields = {}
    return seen


def deltas(seen: list[Seen]) -> list[Seen]:
    return [e for e in seen if e.type == "message.delta"]


def text_of(seen: list[Seen]) -> str:
    return "".join(e.data.get("text", "") for e in deltas(seen))


def committed_response(seen: list[Seen]) -> Seen:
    return next(e for e in seen if e.type == "step.model_response")


def test_deltas_reach_the_reader_before_the_commit_and_concatenate_to_the_answer(
    live_url: str, tenant: TenantHandle, fake: OpenAIServer, drive: Callable[..., str]
) -> None:
    fake.reply(answer(ANSWER, chunks=50, seconds=2.0))
    task_id = submit(live_url, tenant)

    with driven_later(drive, task_id):
        seen = read(live_url, tenant, task_id)

    types = [e.type for e in seen]
    response = committed_response(seen)
    assert "message.delta" in types
    # Every delta comes before the commit it belongs to, and they add up to it.
    assert set(types[types.index("message.delta") : types.index("step.model_response")]) == {
        "message.delta"
    }
    assert text_of(seen) == response.data["content"] == ANSWER
    assert [e.data["index"] for e in deltas(seen)] == list(range(1, len(deltas(seen)) + 1))
    assert len(deltas(seen)) <= 50  # gathered: never more messages than the model's chunks
    # The reader had the first delta while the model was still writing.
    assert deltas(seen)[0].at < fake.sent[-1][0]
    [request] = fake.requests
    assert request.body["stream"] is True
    assert request.body["stream_options"] == {"include_usage": True}
    assert response.data["usage"]["input_tokens"] == 20  # the usage of the stream's last chunk


def test_a_threads_stream_carries_its_turns_deltas_and_resumes_mid_call(
    live_url: str, tenant: TenantHandle, fake: OpenAIServer, drive: Callable[..., str]
) -> None:
    fake.reply(answer(ANSWER, chunks=50, seconds=3.0))
    thread = httpx.post(f"{live_url}/v1/threads", json={}, headers=tenant.headers).json()
    turn = httpx.post(
        f"{live_url}/v1/threads/{thread['id']}/runs",
        json={"input": "Say a hundred words.", "model": MODEL},
        headers=tenant.headers,
    )
    assert turn.status_code == 202, turn.text
    path = "/v1/threads/{}/events"

    def answered(seen: list[Seen]) -> bool:
        return any(e.type == "step.model_response" for e in seen)

    with driven_later(drive, turn.json()["id"]):
        before = read(
            live_url, tenant, thread["id"], path=path, until=lambda seen: len(deltas(seen)) >= 5
        )
        after = read(
            live_url, tenant, thread["id"], path=path, last_event_id=before[-1].id, until=answered
        )

    ids = [e.id for e in before + after]
    assert len(ids) == len(set(ids))  # nothing twice
    assert all(i.startswith("1:") for i in ids)  # the first turn's
    assert before[-1].type == "message.delta"
    assert "." in before[-1].id  # a delta's id: <turn>:<seq>.<pos>
    assert after[0].type == "message.delta"  # resumed mid-call, with the deltas it missed
    types = [e.type for e in before + after]
    assert types.index("step.model_response") > max(
        i for i, t in enumerate(types) if t == "message.delta"
    )
    assert text_of(before + after) == committed_response(after).data["content"] == ANSWER


def test_tool_call_arguments_stream_and_concatenate_to_the_committed_call(
    live_url: str, tenant: TenantHandle, fake: OpenAIServer, drive: Callable[..., str]
) -> None:
    arguments = {"expression": "6*7 + 1000 * (3 - 2) / 4"}
    fake.reply(
        tool_call("calculator", arguments, call_id="call_stream", chunks=12, seconds=0.6),
        answer("The answer is 292.", chunks=5, seconds=0.2),
    )
    task_id = submit(live_url, tenant)

    with driven_later(drive, task_id):
        seen = read(live_url, tenant, task_id)

    first_step = [e for e in deltas(seen) if e.data["step"] == 1]
    pieces = [call for e in first_step for call in e.data.get("tool_calls", [])]
    assert {p["index"] for p in pieces} == {0}
    assert pieces[0]["id"] == "call_stream"
    assert pieces[0]["name"] == "calculator"
    streamed = "".join(p["arguments"] for p in pieces)
    [call] = committed_response(seen).data["tool_calls"]
    assert json.loads(streamed) == call["arguments"] == arguments
    second_step = [e for e in deltas(seen) if e.data["step"] == 2]
    assert "".join(e.data.get("text", "") for e in second_step) == "The answer is 292."


def test_a_reader_that_drops_mid_call_and_resumes_misses_nothing_and_sees_nothing_twice(
    live_url: str, tenant: TenantHandle, fake: OpenAIServer, drive: Callable[..., str]
) -> None:
    fake.reply(answer(ANSWER, chunks=50, seconds=3.0))
    task_id = submit(live_url, tenant)

    with driven_later(drive, task_id):
        before = read(live_url, tenant, task_id, until=lambda seen: len(deltas(seen)) >= 5)
        after = read(live_url, tenant, task_id, last_event_id=before[-1].id)

    ids = [e.id for e in before + after]
    assert len(ids) == len(set(ids))  # nothing twice
    assert text_of(before + after) == committed_response(after).data["content"] == ANSWER
    assert after[0].type == "message.delta"  # resumed mid-call, with the deltas it missed
    committed = [int(e.id) for e in before + after if "." not in e.id]
    assert committed == list(range(1, len(committed) + 1))  # nothing lost of the log either


def test_a_reader_that_held_part_of_a_call_gets_the_rest_even_after_its_commit(
    live_url: str, tenant: TenantHandle, fake: OpenAIServer, drive: Callable[..., str]
) -> None:
    fake.reply(answer(ANSWER, chunks=20, seconds=1.0))
    task_id = submit(live_url, tenant)
    with driven_later(drive, task_id):
        before = read(live_url, tenant, task_id, until=lambda seen: len(deltas(seen)) >= 3)
    # The task has ended: the call it held part of was committed meanwhile.

    after = read(live_url, tenant, task_id, last_event_id=before[-1].id)

    assert text_of(before + after) == committed_response(after).data["content"] == ANSWER
    ids = [e.id for e in before + after]
    assert len(ids) == len(set(ids))


def test_a_reader_that_comes_after_the_commit_gets_the_committed_answer_alone(
    live_url: str, tenant: TenantHandle, fake: OpenAIServer, drive: Callable[..., str]
) -> None:
    fake.reply(answer(ANSWER, chunks=10, seconds=0.5))
    task_id = submit(live_url, tenant)
    with driven_later(drive, task_id):
        whole = read(live_url, tenant, task_id)

    replayed = read(live_url, tenant, task_id)

    assert deltas(whole)
    assert not deltas(replayed)
    assert [e.type for e in replayed] == [e.type for e in whole if e.type != "message.delta"]


def test_a_resume_after_the_commit_does_not_replay_the_calls_deltas(
    live_url: str, tenant: TenantHandle, fake: OpenAIServer, drive: Callable[..., str]
) -> None:
    fake.reply(answer(ANSWER, chunks=10, seconds=0.5))
    task_id = submit(live_url, tenant)
    with driven_later(drive, task_id):
        whole = read(live_url, tenant, task_id)
    last_delta = deltas(whole)[-1]

    resumed = read(live_url, tenant, task_id, last_event_id=last_delta.id)

    assert [e.type for e in resumed] == [e.type for e in whole[whole.index(last_delta) + 1 :]]
    assert not deltas(resumed)


@pytest.mark.parametrize("switch", ["task", "setting"])
def test_streaming_off_asks_for_the_whole_answer_and_sends_no_deltas(
    live_url: str,
    tenant: TenantHandle,
    fake: OpenAIServer,
    drive: Callable[..., str],
    configure: Configure,
    switch: str,
) -> None:
    fake.reply(answer(ANSWER, chunks=10, seconds=0.3))
    if switch == "setting":
        configure(RATCHET_STREAM_DEFAULT="false")
    task_id = submit(live_url, tenant, **({"stream": False} if switch == "task" else {}))

    with driven_later(drive, task_id):
        seen = read(live_url, tenant, task_id)

    [request] = fake.requests
    assert "stream" not in request.body
    assert "stream_options" not in request.body
    assert not deltas(seen)
    assert committed_response(seen).data["content"] == ANSWER


def test_a_cancel_during_a_streaming_call_closes_the_providers_stream(
    live_url: str, tenant: TenantHandle, fake: OpenAIServer, drive: Callable[..., str]
) -> None:
    fake.reply(answer(ANSWER, chunks=100, seconds=60.0))
    task_id = submit(live_url, tenant)
    outcome: list[str] = []
    runner = threading.Thread(target=lambda: outcome.append(drive(task_id)), daemon=True)
    runner.start()
    deadline = time.monotonic() + 30
    while len(fake.sent) < 3:
        assert time.monotonic() < deadline, "the model never began to stream"
        time.sleep(0.05)

    cancelled = httpx.post(f"{live_url}/v1/tasks/{task_id}/cancel", headers=tenant.headers)

    assert cancelled.status_code == 202
    runner.join(timeout=30)
    assert outcome == ["cancelled"]
    # The server saw its stream cut off, long before it would have ended (60 s).
    while not fake.undelivered:
        assert time.monotonic() < deadline, "the provider's stream was left running"
        time.sleep(0.05)
    assert len(fake.sent) < 100


# --- the delta log, on each transport ---------------------------------------------------------


def test_the_delta_log_discards_a_partial_answer_before_a_new_calls_and_refuses_an_older_call(
    backend_env: dict[str, str],
) -> None:
    from shared.deltas import Cursor, Piece, read_deltas
    from shared.transport import get_transport

    task_id = f"task-{uuid.uuid4()}"
    transport = get_transport()

    def piece(epoch: int, attempt: int, said: str, *, step: int = 1) -> Piece:
        return Piece(task_id, step, epoch, attempt, 3, json.dumps({"text": said}))

    transport.append_deltas([piece(1, 1, "a"), piece(1, 1, "b")])
    transport.append_deltas([piece(1, 2, "c")])  # the call failed and was asked again
    transport.append_deltas([piece(2, 1, "d")])  # the step runs again under a new lease
    transport.append_deltas([piece(1, 2, "stale")])  # the old lease's call streams on: refused
    transport.append_deltas([piece(3, 1, "e", step=2)])  # the next step: nothing to discard

    log = read_deltas(task_id, Cursor(3))
    assert [(d.kind, json.loads(d.data)) for d in log] == [
        ("delta", {"text": "a"}),
        ("delta", {"text": "b"}),
        ("discarded", {"step": 1, "reason": "retried"}),
        ("delta", {"text": "c"}),
        ("discarded", {"step": 1, "reason": "rerun"}),
        ("delta", {"text": "d"}),
        ("delta", {"text": "e"}),
    ]
    positions = [d.pos for d in log]
    assert positions == sorted(set(positions))
    assert [d.event_type for d in log[2:4]] == ["message.discarded", "message.delta"]
    # Read on from a position: only what came after it.
    assert read_deltas(task_id, Cursor(3, log[3].pos)) == log[4:]


@pytest.mark.parametrize(
    ("body", "streamed"),
    [({}, True), ({"agent": "quiet"}, False), ({"agent": "quiet", "stream": True}, True)],
    ids=["default", "agent_off", "task_over_agent"],
)
def test_an_agent_turns_streaming_off_and_its_task_may_turn_it_back_on(
    client: Any,
    tenant: TenantHandle,
    drive: Callable[..., str],
    body: dict[str, Any],
    streamed: bool,
) -> None:
    from shared.deltas import Cursor, read_deltas
    from tests.helpers import scripted_task

    sent = scripted_task([{"content": "one two three four", "delay_ms": 40}], **body)
    task_id = client.post("/v1/tasks", json=sent, headers=tenant.headers).json()["id"]

    assert drive(task_id) == "succeeded"
    log = read_deltas(task_id, Cursor(0))
    assert bool(log) is streamed
    if streamed:
        assert "".join(json.loads(d.data)["text"] for d in log) == "one two three four"


def test_deltas_to_a_redis_that_is_down_are_dropped_without_an_error() -> None:
    from shared.deltas import Piece
    from shared.transport import TransportUnavailable
    from shared.transport.redis import RedisTransport

    down = RedisTransport("redis://127.0.0.1:1/0", broker_url=None)

    assert down.append_deltas([Piece("task-1", 1, 1, 1, 2, "{}")]) is False
    with pytest.raises(TransportUnavailable):
        down.read_deltas("task-1", after=0, limit=10)
