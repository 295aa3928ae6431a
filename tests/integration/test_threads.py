"""Threads: each turn's model reads the whole committed history (the client sends only its new
message), and a turn sent to a busy thread does what its ``multitask_strategy`` says."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shared.store.db import transaction
from shared.store.tables import Task
from tests.conftest import Configure, TenantHandle
from tests.fakes.openai_server import OpenAIServer, answer, stall, tool_call
from tests.fakes.reader import Reader, unpaired_calls
from tests.helpers import admit
from tests.integration.test_api import fire_together
from tests.integration.test_context_window import MODEL as READER_MODEL
from tests.integration.test_context_window import RESERVE as READER_RESERVE
from tests.integration.test_context_window import WINDOW as READER_WINDOW
from tests.integration.test_context_window import reader_server  # noqa: F401
from workers.steps import runner

pytestmark = pytest.mark.backends("postgresql", "sqlite")

MODEL = "openai:gpt-4o-mini"
SCRIPTED = {"model": "scripted", "model_options": {"script": [{"content": "ok"}]}}
SYSTEM = "You run operations."  # the ``ops`` agent's (tests/sample_agents.py)
LONG = 60.0


def new_thread(client: TestClient, tenant: TenantHandle, **metadata: str) -> str:
    response = client.post(
        "/v1/threads", json={"agent": "ops", "metadata": metadata}, headers=tenant.headers
    )
    assert response.status_code == 201, response.text
    assert response.headers["Location"] == f"/v1/threads/{response.json()['id']}"
    return str(response.json()["id"])


def send(
    client: TestClient, tenant: TenantHandle, thread_id: str, text: str, **extra: Any
) -> dict[str, Any]:
    body = {"input": text, "model": MODEL, "tools": ["upsert_record"]} | extra
    response = client.post(f"/v1/threads/{thread_id}/runs", json=body, headers=tenant.headers)
    assert response.status_code == 202, response.text
    return dict(response.json())


def row(task_id: str) -> Task:
    with transaction() as session:
        task = session.get(Task, task_id)
        assert task is not None
        session.expunge(task)
        return task


def said_in_turn(k: int) -> list[dict[str, Any]]:
    """What turn ``k`` adds to the history: its message, a tool call and its result, then
    the model's answer (as the requests carry them)."""
    return [
        {"role": "user", "content": f"message {k}"},
        {"role": "assistant", "tool": "upsert_record"},
        {"role": "tool", "content": f"stored key-{k}"},
        {"role": "assistant", "content": f"answer {k}"},
    ]


def shape(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each message reduced to what ``said_in_turn`` names."""
    shaped: list[dict[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            shaped.append({"role": "assistant", "tool": calls[0]["function"]["name"]})
        else:
            shaped.append({"role": message["role"], "content": message["content"]})
    return shaped


def test_each_turn_reads_every_earlier_turn_in_order_and_the_client_sends_only_its_message(
    client: TestClient,
    tenant: TenantHandle,
    openai_provider: OpenAIServer,
    drive: Callable[..., str],
) -> None:
    thread_id = new_thread(client, tenant)
    turns = []
    for k in range(1, 6):
        openai_provider.reply(
            tool_call("upsert_record", {"key": f"key-{k}"}), answer(f"answer {k}")
        )
        turn = send(client, tenant, thread_id, f"message {k}")
        assert (turn["thread_id"], turn["turn"]) == (thread_id, k)
        assert drive(turn["id"]) == "succeeded"
        assert row(turn["id"]).input == f"message {k}"  # all the client sent
        turns.append(turn["id"])

    requests = openai_provider.requests
    assert len(requests) == 10  # two model calls a turn, none repeated
    for k in range(1, 6):
        first = requests[2 * (k - 1)].messages
        earlier = [m for j in range(1, k) for m in said_in_turn(j)]
        assert shape(first) == [
            {"role": "system", "content": SYSTEM},
            *earlier,
            {"role": "user", "content": f"message {k}"},
        ]
    thread = client.get(f"/v1/threads/{thread_id}", headers=tenant.headers).json()
    assert (thread["status"], thread["turns"], thread["latest_turn"]["id"]) == (
        "idle",
        5,
        turns[-1],
    )


def test_reject_refuses_a_turn_while_one_is_unfinished(
    client: TestClient, tenant: TenantHandle
) -> None:
    thread_id = new_thread(client, tenant)
    first = send(client, tenant, thread_id, "message 1", **SCRIPTED)
    response = client.post(
        f"/v1/threads/{thread_id}/runs",
        json={"input": "message 2", "multitask_strategy": "reject"} | SCRIPTED,
        headers=tenant.headers,
    )
    assert response.status_code == 409
    assert response.headers["content-type"] == "application/problem+json"
    thread = client.get(f"/v1/threads/{thread_id}", headers=tenant.headers).json()
    assert (thread["turns"], thread["latest_turn"]["id"], thread["status"]) == (
        1,
        first["id"],
        "busy",
    )


def test_enqueue_runs_after_the_unfinished_turn_and_sees_its_answer(
    client: TestClient,
    tenant: TenantHandle,
    openai_provider: OpenAIServer,
    drive: Callable[..., str],
) -> None:
    thread_id = new_thread(client, tenant)
    openai_provider.reply(answer("answer 1"), answer("answer 2"))
    first = send(client, tenant, thread_id, "message 1")
    second = send(client, tenant, thread_id, "message 2")  # enqueue: the default

    # Held: never admitted, and a message for it (a stray, a duplicate) takes no lease.
    admit()
    runner.advance(second["id"], 1)
    held = row(second["id"])
    assert (held.status, held.turn_held, held.admitted_ms, held.steps) == ("queued", True, None, 0)
    assert openai_provider.requests == []

    assert drive(first["id"]) == "succeeded"
    assert admit() >= 1  # the dispatcher's round releases it, and admits it
    assert row(second["id"]).turn_held is False
    assert drive(second["id"]) == "succeeded"
    assert shape(openai_provider.requests[1].messages) == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "message 1"},
        {"role": "assistant", "content": "answer 1"},
        {"role": "user", "content": "message 2"},
    ]


def test_two_turns_of_a_thread_are_never_released_at_once(
    client: TestClient, tenant: TenantHandle
) -> None:
    """The database refuses a second unfinished turn that is not held, whatever the code."""
    from sqlalchemy import update
    from sqlalchemy.exc import IntegrityError

    thread_id = new_thread(client, tenant)
    send(client, tenant, thread_id, "message 1", **SCRIPTED)
    second = send(client, tenant, thread_id, "message 2", **SCRIPTED)
    with pytest.raises(IntegrityError), transaction() as session:
        session.execute(update(Task).where(Task.id == second["id"]).values(turn_held=False))


@pytest.mark.parametrize("strategy", ["interrupt", "rollback"])
def test_interrupt_and_rollback_cancel_the_turn_in_its_slow_model_call(
    strategy: str,
    client: TestClient,
    tenant: TenantHandle,
    openai_provider: OpenAIServer,
    drive: Callable[..., str],
    configure: Configure,
) -> None:
    configure(RATCHET_LEASE_TTL_SECONDS="0.9")  # the heartbeat looks at the task every 0.3 s
    thread_id = new_thread(client, tenant)
    openai_provider.reply(
        tool_call("upsert_record", {"key": "key-1"}),  # step 1 commits, its tool ran
        stall(30, then=answer("never read")),  # step 2's model call is slow
        answer("answer 2"),
    )
    first = send(client, tenant, thread_id, "message 1")
    running = threading.Thread(target=drive, args=(first["id"],))
    running.start()
    deadline = time.monotonic() + LONG
    while len(openai_provider.requests) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(openai_provider.requests) == 2  # in the slow call, step 1 committed

    second = send(client, tenant, thread_id, "message 2", multitask_strategy=strategy)
    assert row(second["id"]).turn_held  # waits for the interrupted turn to end
    running.join(LONG)
    assert not running.is_alive()
    cancelled = row(first["id"])
    assert (cancelled.status, cancelled.steps) == ("cancelled", 1)
    assert cancelled.rolled_back is (strategy == "rollback")

    admit()
    assert drive(second["id"]) == "succeeded"
    kept = [
        {"role": "user", "content": "message 1"},
        {"role": "assistant", "tool": "upsert_record"},
        {"role": "tool", "content": "stored key-1"},
    ]
    assert shape(openai_provider.requests[2].messages) == [
        {"role": "system", "content": SYSTEM},
        *(kept if strategy == "interrupt" else []),
        {"role": "user", "content": "message 2"},
    ]
    # Rolled back or not, the turn's rows stay for audit.
    steps = client.get(f"/v1/tasks/{first['id']}/steps", headers=tenant.headers).json()
    assert [s["number"] for s in steps["items"]] == [1]


def test_interrupt_of_a_turn_no_worker_holds_cancels_it_at_once(
    client: TestClient, tenant: TenantHandle
) -> None:
    thread_id = new_thread(client, tenant)
    first = send(client, tenant, thread_id, "message 1", **SCRIPTED)
    second = send(
        client, tenant, thread_id, "message 2", multitask_strategy="interrupt", **SCRIPTED
    )
    assert row(first["id"]).status == "cancelled"
    assert row(second["id"]).turn_held is False  # nothing unfinished before it: not held


def test_the_context_policy_cuts_the_whole_history_keeping_the_first_message_and_pairs(
    reader_server: Callable[[int], tuple[OpenAIServer, Reader]],  # noqa: F811
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
) -> None:
    """Turn 1 reads a book far past the window; turn 2's model still gets a prompt inside
    it: the system prompt and the thread's first message, the newest turns whole (no tool
    call without its result), and turn 2's own message."""
    _server, reader = reader_server(30)
    created = client.post("/v1/threads", json={"agent": "reader"}, headers=tenant.headers)
    thread_id = created.json()["id"]
    for text in ("Read the book.", "Now tell me what you read."):
        response = client.post(
            f"/v1/threads/{thread_id}/runs",
            json={"input": text, "model": READER_MODEL, "max_steps": 50}
            | {"context": {"policy": "truncate"}},
            headers=tenant.headers,
        )
        assert response.status_code == 202, response.text
        assert drive(response.json()["id"], max_messages=80) == "succeeded"

    last = reader.prompts[-1]
    assert len(reader.prompts) == 32  # 30 pages and an answer, then turn 2's answer
    assert max(reader.sizes) + READER_RESERVE <= READER_WINDOW
    assert last[:2] == reader.prompts[0][:2]  # the system prompt, the thread's first message
    assert last[-1] == {"role": "user", "content": "Now tell me what you read."}
    assert any("left out here" in str(m["content"]) for m in last)
    assert all(unpaired_calls(prompt) == [] for prompt in reader.prompts)


def test_a_fork_holds_the_turns_it_was_forked_at_and_asks_nothing_again(
    client: TestClient,
    tenant: TenantHandle,
    openai_provider: OpenAIServer,
    drive: Callable[..., str],
    journal: Path,
) -> None:
    source = new_thread(client, tenant)
    for k in (1, 2, 3):
        openai_provider.reply(
            tool_call("upsert_record", {"key": f"key-{k}"}), answer(f"answer {k}")
        )
        assert drive(send(client, tenant, source, f"message {k}")["id"]) == "succeeded"
    asked, effects = len(openai_provider.requests), journal.read_text().splitlines()
    assert (asked, len(effects)) == (6, 3)

    response = client.post(f"/v1/threads/{source}/fork", json={"turn": 2}, headers=tenant.headers)
    assert response.status_code == 201, response.text
    fork = response.json()
    assert fork["forked_from"] == {"thread_id": source, "turn": 2}
    assert (fork["turns"], fork["status"], fork["agent"]) == (2, "idle", "ops")
    assert len(openai_provider.requests) == asked  # forking asks the model nothing
    assert journal.read_text().splitlines() == effects  # and runs no tool

    openai_provider.reply(answer("answer to the fork"))
    turn = send(client, tenant, fork["id"], "message 3b")
    assert (turn["thread_id"], turn["turn"]) == (fork["id"], 3)
    assert drive(turn["id"]) == "succeeded"
    assert len(openai_provider.requests) == asked + 1  # only the fork's own turn
    assert journal.read_text().splitlines() == effects
    assert shape(openai_provider.requests[-1].messages) == [
        {"role": "system", "content": SYSTEM},
        *said_in_turn(1),
        *said_in_turn(2),
        {"role": "user", "content": "message 3b"},
    ]
    messages = client.get(f"/v1/threads/{fork['id']}/messages", headers=tenant.headers).json()
    assert [(m["turn"], m["role"]) for m in messages["items"]][-2:] == [
        (3, "user"),
        (3, "assistant"),
    ]
    assert len(messages["items"]) == 4 + 4 + 2
    # The source is untouched, and holds its fork's history: it is not deleted under it.
    source_view = client.get(f"/v1/threads/{source}", headers=tenant.headers).json()
    assert (source_view["turns"], source_view["forked_from"]) == (3, None)
    refused = client.delete(f"/v1/threads/{source}", headers=tenant.headers)
    assert refused.status_code == 409
    assert client.delete(f"/v1/threads/{fork['id']}", headers=tenant.headers).status_code == 204
    assert client.delete(f"/v1/threads/{source}", headers=tenant.headers).status_code == 204


def test_a_fork_needs_a_turn_the_thread_has_and_has_ended(
    client: TestClient, tenant: TenantHandle, make_tenant: Callable[..., TenantHandle]
) -> None:
    source = new_thread(client, tenant)
    send(client, tenant, source, "message 1", **SCRIPTED)  # queued: unfinished
    for body, status in (
        ({"turn": 1}, 409),
        ({"turn": 2}, 422),
        ({"turn": 0}, 422),
        ({"turn": "one"}, 422),
    ):
        response = client.post(f"/v1/threads/{source}/fork", json=body, headers=tenant.headers)
        assert response.status_code == status, (body, response.text)
        assert response.headers["content-type"] == "application/problem+json"
    other = client.post(
        f"/v1/threads/{source}/fork", json={"turn": 1}, headers=make_tenant().headers
    )
    assert other.status_code == 404
    listed = client.get("/v1/threads", headers=tenant.headers).json()["items"]
    assert [t["id"] for t in listed] == [source]  # nothing was created


def test_turns_sent_at_once_are_numbered_in_turn_and_only_the_first_is_not_held(
    live_url: str,
    tenant: TenantHandle,
) -> None:
    """Ten turns at once on an idle thread (real HTTP, one thread each): ten numbers, one
    runnable turn, nine waiting behind it; the same with every one an ``interrupt``."""
    import httpx

    with httpx.Client(base_url=live_url, headers=tenant.headers) as http:
        thread_id = http.post("/v1/threads", json={"agent": "ops"}).json()["id"]
    for strategy in ("enqueue", "interrupt"):
        body = {"input": "hi", "multitask_strategy": strategy} | SCRIPTED
        answers = fire_together(
            live_url,
            lambda http, body=body: http.post(
                f"/v1/threads/{thread_id}/runs", json=body, headers=tenant.headers
            ),
            count=10,
        )
        assert [a.status_code for a in answers] == [202] * 10, [a.text for a in answers]
        with transaction() as session:
            turns = session.query(Task).filter(Task.thread_id == thread_id).all()
            unfinished = [t for t in turns if t.status not in ("succeeded", "failed", "cancelled")]
            runnable = [t.turn for t in unfinished if not t.turn_held]
        assert sorted(t.turn for t in turns) == list(range(1, len(turns) + 1))
        assert len(runnable) <= 1, runnable
        if strategy == "enqueue":
            assert runnable == [1]
        else:  # each cancelled the ones before it, none of which a worker held
            assert [t.turn for t in unfinished] == [20]
