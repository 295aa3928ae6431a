"""Running a tool: a failure, a timeout or a result JSON cannot hold becomes an error outcome
the model reads, never a crash; a result is kept as JSON reads it back."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from shared.agents.registry import Tool, ToolContext, get_tool, load
from shared.errors import ToolError
from workers import tool_runner
from workers.tool_runner import as_json

CONTEXT = ToolContext(task_id="t", tenant_id="x", call_id="1-0", idempotency_key="t:1-0")


def test_a_failing_tool_becomes_an_error_outcome_not_a_crash() -> None:
    load()
    outcome = tool_runner.execute(get_tool("calculator"), {"expression": "1/0"}, CONTEXT)
    assert not outcome.ok
    assert "cannot evaluate" in (outcome.error or "")
    bad = tool_runner.execute(get_tool("calculator"), {"expr": "1"}, CONTEXT)
    assert not bad.ok
    assert "invalid arguments" in (bad.error or "")


def test_a_slow_tool_times_out() -> None:
    load()
    slow = replace(get_tool("sleep"), timeout=0.1)
    outcome = tool_runner.execute(slow, {"seconds": 2}, CONTEXT)
    assert not outcome.ok
    assert "timed out" in (outcome.error or "")


def _returning(value: Any) -> Tool:
    """The calculator's signature, returning ``value`` whatever it is asked."""
    load()
    return replace(get_tool("calculator"), func=lambda expression: value)


def _raising(exc: Exception) -> Tool:
    def fail(expression: str) -> None:
        raise exc

    load()
    return replace(get_tool("calculator"), func=fail)


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        pytest.param(float("nan"), "Out of range float", id="nan"),
        pytest.param(float("inf"), "Out of range float", id="inf"),
        pytest.param({"rows": [1.0, -float("inf")]}, "Out of range float", id="nested-inf"),
        pytest.param(10**5000, "limit (4300 digits)", id="big-int"),
        pytest.param([1, {"n": 10**5000}], "limit (4300 digits)", id="nested-big-int"),
        pytest.param(object(), "not JSON serializable", id="object"),
        pytest.param({1, 2}, "not JSON serializable", id="set"),
        pytest.param({(1, 2): "a tuple key"}, "keys must be", id="tuple-key"),
        pytest.param("a\x00b", "NUL", id="nul"),
        pytest.param({"text": "\\\x00"}, "NUL", id="escaped-backslash-then-nul"),
        pytest.param(["\ud800"], "lone surrogate", id="lone-surrogate"),
        pytest.param(_nested(100_000), "recursion", id="too-deep"),
    ],
)
def test_a_result_json_cannot_hold_goes_back_to_the_model_as_an_error(
    result: Any, reason: str
) -> None:
    outcome = tool_runner.execute(_returning(result), {"expression": "1"}, CONTEXT)
    assert not outcome.ok
    assert outcome.result is None
    assert outcome.error is not None
    assert "calculator returned a result that JSON cannot hold" in outcome.error
    assert reason in outcome.error
    assert as_json(outcome.error) == outcome.error  # the error itself is storable


@pytest.mark.parametrize(
    ("result", "stored"),
    [
        ((1, 2.5, None), [1, 2.5, None]),
        ({1: "a", "b": True}, {"1": "a", "b": True}),
        ("a literal \\u0000 is text, not a NUL", "a literal \\u0000 is text, not a NUL"),
        (10**4000, 10**4000),
        ("é ☃ 𝄞", "é ☃ 𝄞"),
    ],
)
def test_a_result_is_kept_as_json_reads_it_back(result: Any, stored: Any) -> None:
    outcome = tool_runner.execute(_returning(result), {"expression": "1"}, CONTEXT)
    assert outcome.ok, outcome.error
    assert outcome.result == stored


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ToolError("bad \x00 byte and \udc80 half"), "bad \\x00 byte and \\udc80 half"),
        (RuntimeError("nul \x00"), "calculator raised RuntimeError: nul \\x00"),
        (ValueError(10**5000), "calculator raised ValueError: a message that cannot be shown"),
    ],
)
def test_an_error_message_is_storable_text(exc: Exception, expected: str) -> None:
    outcome = tool_runner.execute(_raising(exc), {"expression": "1"}, CONTEXT)
    assert not outcome.ok
    assert outcome.error == expected


def test_a_long_result_is_cut_with_its_start_and_end_around_a_note() -> None:
    text = "a" * 3_000 + "b" * 7_000
    cut = tool_runner.cut_text(text, 1_000)
    assert cut.startswith("a" * 750)
    assert cut.endswith("b" * 250)
    assert "9,000 of 10,000 characters cut out here" in cut
    assert tool_runner.cut_text("short", 1_000) == "short"
    content = tool_runner.message_content(
        ok=True, result={"k": "v" * 5_000}, error=None, max_chars=500
    )
    assert len(content) < 700
    assert tool_runner.message_content(
        ok=False, result=None, error="e" * 900, max_chars=200
    ).startswith("error: eee")


def test_a_tools_own_limit_wins_over_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    load()
    limited = replace(get_tool("calculator"), max_result_chars=1_234)
    monkeypatch.setitem(tool_runner.get_registry().tools, "calculator", limited)
    assert tool_runner.result_limit("calculator") == 1_234
    assert tool_runner.result_limit("current_time") == 50_000  # RATCHET_TOOL_RESULT_MAX_CHARS
    assert tool_runner.result_limit("a server's tool") == 50_000
