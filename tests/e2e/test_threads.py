"""A thread against real processes: five turns sent at once (each only its new message), a
worker killed with SIGKILL in turn 3, and still every turn runs after the one before it, reads
all of them, and nothing is lost or done twice."""

from __future__ import annotations

import re
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from tests.conftest import TenantHandle
from tests.e2e.conftest import FAST_RECOVERY, Stack, StackFactory
from tests.e2e.util import wait_all
from tests.fakes.openai_server import OpenAIServer, Received, Reply, answer, tool_call

# Killed workers leave unacked messages behind.
pytestmark = pytest.mark.usefixtures("forget_unacked")

MODEL = "openai:gpt-thread-test"
TURNS = 5
KILLED_TURN = 3
TURN_MARKER = re.compile(r"^message (\d+)$")


def turn_and_step(messages: list[dict[str, Any]]) -> tuple[int, int]:
    """Which turn asks (its message is the last user message) and for which of its steps."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    found = TURN_MARKER.match(str(messages[last]["content"]))
    assert found is not None, messages
    return int(found[1]), 1 + sum(m["role"] == "assistant" for m in messages[last + 1 :])


class Chat:
    """The model: a turn's step 1 stores a record, its step 2 answers. When turn 3 asks for
    its step 2 (step 1's answer and tool call committed), the worker asking is killed."""

    def __init__(self) -> None:
        self.fleet: Stack | None = None
        self.turn_ids: dict[int, str] = {}
        self.asked: list[tuple[int, int, list[dict[str, Any]]]] = []
        self.killed = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, request: Received) -> Reply:
        turn, step = turn_and_step(request.messages)
        with self._lock:
            self.asked.append((turn, step, request.messages))
            kill = (turn, step) == (KILLED_TURN, 2) and not self.killed.is_set()
            if kill:
                self.killed.set()
        if kill:
            self._kill_holder(self.turn_ids[KILLED_TURN])
        if step == 1:
            return tool_call("upsert_record", {"key": f"key-{turn}"})
        return answer(f"answer {turn}")

    def _kill_holder(self, task_id: str) -> None:
        from shared.store.db import transaction
        from shared.store.tables import Task

        assert self.fleet is not None
        with transaction() as session:
            owner = session.scalar(select(Task.lease_owner).where(Task.id == task_id))
        assert owner is not None
        pid = int(owner.split(":")[-2])
        index = next(
            i for i in range(len(self.fleet.worker_procs)) if pid in self.fleet.worker_child_pids(i)
        )
        self.fleet.kill_worker(index)


def history_through(turn: int) -> list[tuple[str, str]]:
    """(role, text) of every message turns 1..``turn`` add to the conversation."""
    said: list[tuple[str, str]] = []
    for k in range(1, turn + 1):
        said += [
            ("user", f"message {k}"),
            ("assistant", "upsert_record"),
            ("tool", f"stored key-{k}"),
            ("assistant", f"answer {k}"),
        ]
    return said


def shape(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    shaped = []
    for message in messages:
        if message["role"] == "system":
            continue
        calls = message.get("tool_calls")
        text = calls[0]["function"]["name"] if calls else str(message["content"])
        shaped.append((message["role"], text))
    return shaped


def test_a_worker_killed_in_turn_3_of_5_loses_nothing_and_repeats_nothing(
    stack: StackFactory, tenant: TenantHandle, tmp_path: Path
) -> None:
    journal = tmp_path / "journal"
    journal.touch()
    chat = Chat()
    with OpenAIServer(responder=chat) as llm:
        env = {
            **FAST_RECOVERY,
            "RATCHET_OPENAI_BASE_URL": llm.base_url,
            "RATCHET_OPENAI_API_KEY": "sk-test",
            "RATCHET_MODEL_TIMEOUT_SECONDS": "20",
            "RATCHET_TEST_JOURNAL": str(journal),
        }
        fleet = chat.fleet = stack(workers=2, concurrency=1, env=env)
        with fleet.client(headers=tenant.headers) as http:
            created = http.post("/v1/threads", json={"agent": "ops"})
            assert created.status_code == 201, created.text
            thread_id = created.json()["id"]
            for k in range(1, TURNS + 1):  # all at once: each waits for the one before it
                body = {"input": f"message {k}", "model": MODEL, "tools": ["upsert_record"]}
                sent = http.post(f"/v1/threads/{thread_id}/runs", json=body)
                assert sent.status_code == 202, sent.text
                chat.turn_ids[sent.json()["turn"]] = sent.json()["id"]
            tasks = wait_all(http, None, chat.turn_ids.values(), timeout=120)
            thread = http.get(f"/v1/threads/{thread_id}").json()

    assert chat.killed.is_set(), "turn 3's worker was not killed"
    assert {task["status"] for task in tasks.values()} == {"succeeded"}
    assert thread["status"] == "idle"
    # One turn at a time, in order: every request of turn k before any of turn k + 1.
    order = [turn for turn, _, _ in chat.asked]
    assert order == sorted(order)
    # Each model call once, but the one the kill cut short, asked again once.
    asked = Counter((turn, step) for turn, step, _ in chat.asked)
    assert asked == {
        (k, s): 2 if (k, s) == (KILLED_TURN, 2) else 1 for k in range(1, TURNS + 1) for s in (1, 2)
    }
    # Each side effect once (the killed turn's ran before the kill and is not run again).
    assert sorted(journal.read_text().splitlines()) == sorted(
        f"upsert {chat.turn_ids[k]}:1-0" for k in range(1, TURNS + 1)
    )
    # Turn k's first request holds every earlier turn, in order, then its own message only.
    for turn, step, messages in chat.asked:
        expected = [*history_through(turn - 1), ("user", f"message {turn}")]
        if step == 2:
            expected += [("assistant", "upsert_record"), ("tool", f"stored key-{turn}")]
        assert shape(messages) == expected, (turn, step)
