"""What ``ratchet chat`` prints for a turn's events, piped (no styles): a failed turn says
why, a step whose call is asked again is told and its new text follows, a committed
answer prints only what the live pieces had not shown (all of it when none came), and a turn
that waits shows the question it asks the person (and stops there for the answer)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from ratchet.cli_chat import Answer, show_event
from ratchet.client import Client, Event


def shown(events: list[tuple[str, dict[str, Any]]], capsys: pytest.CaptureFixture[str]) -> str:
    answer = Answer()
    client = cast(Client, None)  # only a wait for approval uses it
    for kind, data in events:
        show_event(client, Event(0, kind, data), answer)
    answer.end_line()
    return capsys.readouterr().out


def test_a_failed_turn_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    out = shown([("task.failed", {"error": "budget exceeded: cost_usd 0.50"})], capsys)
    assert out == "error: the turn failed: budget exceeded: cost_usd 0.50\n"


def test_a_discarded_answer_is_told_and_the_new_one_follows(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = shown(
        [
            ("message.delta", {"step": 1, "text": "The ans"}),
            ("message.discarded", {"step": 1, "reason": "retried"}),
            ("message.delta", {"step": 1, "text": "It is "}),
            ("step.model_response", {"step": 1, "content": "It is 42.", "tool_calls": []}),
        ],
        capsys,
    )
    assert out == (
        "agent> The ans\n(that answer was cut off; it is asked again)\nagent> It is 42.\n"
    )


def test_a_committed_answer_shows_what_the_pieces_did_not(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = shown(
        [
            (
                "step.model_response",
                {
                    "step": 1,
                    "content": "",
                    "tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}],
                },
            ),
            (
                "step.tool_call",
                {
                    "step": 1,
                    "name": "calculator",
                    "status": "succeeded",
                    "result": "42",
                    "error": None,
                },
            ),
            ("step.model_response", {"step": 2, "content": "It is 42.", "tool_calls": []}),
        ],
        capsys,
    )
    assert out == (
        '  tool calculator {"expression": "6*7"}\n  calculator succeeded: 42\nagent> It is 42.\n'
    )


def test_a_turn_that_asks_shows_its_question_and_stops_for_the_answer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    question = {
        "kind": "token",
        "tool": "ask_user",
        "status": "pending",
        "token": "wt_1",
        "request": {"question": "Staging or production?"},
    }
    child = {"kind": "child", "tool": "researcher", "status": "pending", "child_id": "c-1"}
    answer = Answer()
    client = cast(Client, None)
    parked = {"step": 1, "name": "researcher", "status": "waiting", "wait": child}
    assert show_event(client, Event(3, "step.tool_call", parked), answer) is False
    waiting = {"id": "t-1", "waiting": {"step": 1, "waits": [child, question]}}
    assert show_event(client, Event(4, "task.waiting", waiting), answer) is True
    only_children = {"id": "t-1", "waiting": {"step": 1, "waits": [child]}}
    assert show_event(client, Event(4, "task.waiting", only_children), answer) is False
    assert capsys.readouterr().out == (
        "  researcher started sub-agent task c-1\n"
        "agent asks> Staging or production?\n"
        "(your next line answers it)\n"
    )
