"""The Python client's threads and live answer text, and ``ratchet chat`` in a pseudo-terminal,
against one running API and worker shared by the module's tests (none of them stops a process).

``ratchet chat`` is run as a person would: a real process whose stdin and stdout are a pty.
Its answer must show while the model is still writing it (the scripted model spreads its
``delay_ms`` over its words): the first words are on the terminal before the turn's task has
finished, and before its last word."""

from __future__ import annotations

import contextlib
import json
import re
import signal
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from ratchet.client import Client, RatchetAPIError, TextPiece
from tests.e2e.conftest import module_stack_fixture, run_ratchet
from tests.e2e.util import Terminal
from tests.helpers import scripted_task, tool_turn

WORDS = "The transfer went through and the money is on its way to alice before the end of today"
SCRIPT = [tool_turn("wire_money", to="alice", amount=900), {"content": WORDS, "delay_ms": 2000}]
RESUME = re.compile(r"ratchet chat --thread (\S+)")


module_stack = module_stack_fixture("chat")


def answer(text: str, delay_ms: int = 0) -> dict[str, Any]:
    return {
        "model": "scripted",
        "model_options": {"script": [{"content": text, "delay_ms": delay_ms}]},
    }


# --- the Python client -------------------------------------------------------------------------


def test_the_client_runs_turns_and_reads_forks_lists_and_deletes_threads(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("ratchet.client.MESSAGES_PAGE", 1)  # messages() reads every page
    thread = client.create_thread(agent="default", metadata={"customer": "42"})
    other = client.create_thread(metadata={"customer": "7"})
    first = client.run(thread["id"], "What is 6*7?", **answer("42"))
    assert first["turn"] == 1
    assert client.wait(first["id"], timeout=60)["status"] == "succeeded"
    second = client.run(thread["id"], "And times 2?", multitask_strategy="reject", **answer("84"))
    client.wait(second["id"], timeout=60)

    assert [(m["turn"], m["role"], m["content"]) for m in client.messages(thread["id"])] == [
        (1, "user", "What is 6*7?"),
        (1, "assistant", "42"),
        (2, "user", "And times 2?"),
        (2, "assistant", "84"),
    ]
    assert client.get_thread(thread["id"])["turns"] == 2
    listed = client.list_threads(metadata={"customer": "42"})["items"]
    assert [t["id"] for t in listed] == [thread["id"]]
    fork = client.fork_thread(thread["id"], 1, metadata={"customer": "7"})
    assert fork["forked_from"] == {"thread_id": thread["id"], "turn": 1}
    assert {t["id"] for t in client.list_threads(metadata={"customer": "7"})["items"]} == {
        fork["id"],
        other["id"],
    }
    assert [m["content"] for m in client.messages(fork["id"])] == ["What is 6*7?", "42"]

    with pytest.raises(RatchetAPIError) as held:  # the fork reads its history from it
        client.delete_thread(thread["id"])
    assert held.value.status == 409
    client.delete_thread(fork["id"])
    client.delete_thread(thread["id"])
    with pytest.raises(RatchetAPIError) as gone:
        client.get_thread(thread["id"])
    assert gone.value.status == 404


def test_thread_events_resume_after_any_id_without_repeating_one(client: Client) -> None:
    thread = client.create_thread()
    for text in ("one", "two"):
        client.wait(client.run(thread["id"], text, **answer(text))["id"], timeout=60)

    everything = until_turn_ends(client.thread_events(thread["id"]), turn=2)
    ids = [e.id for e in everything]
    assert ids[0] == "1:1"
    assert len(set(ids)) == len(ids)
    middle = len(ids) // 2
    rest = until_turn_ends(client.thread_events(thread["id"], after=ids[middle]), turn=2)
    assert [e.id for e in rest] == ids[middle + 1 :]


def until_turn_ends(events: Iterator[Any], *, turn: int) -> list[Any]:
    """The thread stream's events up to the end of ``turn`` (the stream itself never ends)."""
    seen = []
    for event in events:
        seen.append(event)
        if event.id.startswith(f"{turn}:") and event.type == "task.succeeded":
            return seen
    raise AssertionError("the thread's stream ended")


def test_live_deltas_come_before_the_commit_and_stream_text_resumes_after_one(
    client: Client,
) -> None:
    text = " ".join(f"word{i}" for i in range(30))
    task = client.submit(scripted_task([{"content": text, "delay_ms": 1500}]))

    everything = list(client.events(task["id"], deltas=True))  # read while it is written

    kinds = [e.type for e in everything]
    deltas = [e for e in everything if e.type == "message.delta"]
    assert len(deltas) > 1
    assert "".join(e.data["text"] for e in deltas) == text
    assert kinds.index("step.model_response") > kinds.index("message.delta")
    assert "message.discarded" not in kinds
    first = deltas[0]
    # After a delta's "<seq>.<pos>" id: the call's other pieces, then its committed answer.
    pieces = list(client.stream_text(task["id"], after=first.id))
    assert "".join(p.text for p in pieces[:-1]) == text.removeprefix(first.data["text"])
    assert pieces[-1] == TextPiece(1, text, committed=True)
    # The committed events only, resumed after either kind of id: the rest, once each.
    committed = [e.id for e in everything if e.type != "message.delta"]
    after = [e.id for e in client.events(task["id"], after=first.id)]
    assert after == [i for i in committed if int(i) > first.seq]
    assert [e.seq for e in client.events(task["id"], after=first.seq)] == [int(i) for i in after]


# --- ratchet chat in a pseudo-terminal ----------------------------------------------------------


def exit_chat(chat: Terminal) -> str:
    """Type ``/exit`` at the next prompt; the chat exits 0, printing the command that resumes
    its thread, whose id this returns."""
    chat.wait_for("you> ")
    chat.type("/exit\n")
    chat.wait_for("--thread ")
    chat.wait_for("\n")
    assert chat.close() == 0
    thread_id: str = RESUME.findall(chat.output)[-1]
    return thread_id


def test_ratchet_chat_streams_shows_tools_asks_approvals_and_resumes(
    terminal: Callable[..., Terminal], client: Client, user: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    chat = terminal("chat", "--agent", "ops", "--script", str(script))
    chat.wait_for("you> ")
    chat.type("send alice 900\n")
    chat.wait_for('tool wire_money {"to": "alice", "amount": 900}')
    chat.wait_for("[a]pprove, [r]eject or [e]dit? ")
    chat.type("a\n")
    chat.wait_for("wire_money succeeded: wired 900 to alice")

    first_words = chat.wait_for("The transfer")
    shown_then = chat.output
    last_word = chat.wait_for("today")
    thread_id = exit_chat(chat)

    [turn] = [client.get_thread(thread_id)["latest_turn"]]
    assert turn["status"] == "succeeded"
    assert turn["result"] == {"output": WORDS}
    finished = datetime.fromisoformat(turn["finished_at"]).timestamp()
    # The answer was on the terminal while it was being written: its first words before its
    # last, and before the turn's task committed it.
    assert "today" not in shown_then.partition("The transfer")[2]
    assert first_words < last_word
    assert first_words < finished
    assert "\x1b[" in chat.output  # styled, on a terminal

    resumed = terminal("chat", "--thread", thread_id, "--agent", "ops", "--script", str(script))
    for line in (f"thread {thread_id} (ops)", "you> send alice 900", "tool wire_money"):
        resumed.wait_for(line)
    for line in ("wire_money succeeded", f"agent> {WORDS}"):
        resumed.wait_for(line)
    resumed.wait_for("you> ")
    resumed.type("again\n")
    resumed.wait_for("[a]pprove, [r]eject or [e]dit? ")
    resumed.type("e\n")
    resumed.wait_for("arguments (JSON, were ")
    resumed.type("bob\n")  # not JSON: said so, and asked again
    resumed.wait_for("--edit is not JSON")
    resumed.wait_for("[a]pprove, [r]eject or [e]dit? ")
    resumed.type('e\n{"to": "bob", "amount": 5}\n')
    resumed.wait_for("wire_money edited by key:")
    resumed.wait_for("wire_money succeeded: wired 5 to bob")
    resumed.wait_for(f"agent> {WORDS}")
    resumed.wait_for("you> ")
    resumed.type("once more\n")
    resumed.wait_for("[a]pprove, [r]eject or [e]dit? ")
    resumed.proc.send_signal(signal.SIGINT)  # Ctrl-C while the turn waits: it is cancelled
    # A signal that lands just before the prompt blocks is only seen once a key is read (a
    # person would not be that quick); Enter makes sure, wherever it lands.
    resumed.type("\n")
    resumed.wait_for("(turn 3 cancelled")
    resumed.wait_for("you> ")
    # Ctrl-D at the prompt ends the chat. When that Enter was read as an empty line, a Ctrl-D
    # typed before the next prompt can be lost in the terminal's switch between line and raw
    # mode: a person would press it again, and so does the test, until the chat ends.
    for _ in range(10):
        resumed.type("\x04")  # Ctrl-D
        with contextlib.suppress(AssertionError):
            resumed.wait_for(f"ratchet chat --thread {thread_id}", timeout=10)
            break
    else:
        raise AssertionError(f"Ctrl-D never ended the chat; the terminal shows:\n{resumed.output}")
    assert resumed.close() == 0
    latest = client.get_thread(thread_id)["latest_turn"]
    assert latest["turn"] == 3
    assert client.wait(latest["id"], timeout=60)["status"] == "cancelled"

    piped = run_ratchet("chat", "--thread", thread_id, env=user, cwd=tmp_path, input="", timeout=60)
    assert piped.returncode == 0, piped.stderr
    assert f"agent> {WORDS}" in piped.stdout
    assert "you> again" in piped.stdout
    assert "wire_money succeeded: wired 5 to bob" in piped.stdout
    assert "\x1b" not in piped.stdout  # not a terminal: plain text


def test_ratchet_chat_shows_the_question_a_turn_asks_and_the_next_line_answers_it(
    terminal: Callable[..., Terminal], client: Client, tmp_path: Path
) -> None:
    script = tmp_path / "ask.json"
    ask = tool_turn("ask_user", question="Staging or production?")
    script.write_text(json.dumps([ask, {"content": "Deploying to staging now."}]))
    chat = terminal("chat", "--agent", "default", "--script", str(script))
    chat.wait_for("you> ")
    chat.type("deploy the release\n")
    chat.wait_for("agent asks> Staging or production?")
    chat.wait_for("(your next line answers it)")
    chat.wait_for("you> ")  # the turn waits; the prompt is back for the answer
    chat.type("staging\n")
    chat.wait_for("ask_user succeeded: staging")
    chat.wait_for("agent> Deploying to staging now.")
    thread_id = exit_chat(chat)

    # One turn, whose call's result is the answer; the turn was followed on from where it
    # asked, so nothing of it was shown twice.
    thread = client.get_thread(thread_id)
    assert (thread["turns"], thread["latest_turn"]["status"]) == (1, "succeeded")
    [call] = [c for step in client.steps(thread["latest_turn"]["id"]) for c in step["tool_calls"]]
    assert (call["name"], call["result"]) == ("ask_user", "staging")
    assert chat.output.count("agent asks>") == 1
    assert chat.output.count("tool ask_user") == 1
    assert [m["role"] for m in client.messages(thread_id)] == [
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
