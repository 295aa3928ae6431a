"""Built-in tools and the registry's validation, with no services."""

from __future__ import annotations

import pytest

from shared.agents.builtin_tools import calculator, current_time
from shared.agents.registry import ToolContext, get_tool, load
from shared.errors import ToolArgumentsInvalid, ToolError
from workers import tool_runner

CONTEXT = ToolContext(task_id="t", tenant_id="x", call_id="1-0", idempotency_key="t:1-0")


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("6*7", 42),
        ("2**10", 1024),
        ("(1+2)*3 - 4/2", 7.0),
        ("sqrt(16) + abs(-1)", 5.0),
        ("-3 % 2", 1),
    ],
)
def test_calculator_evaluates_arithmetic(expression: str, expected: float) -> None:
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "open('/etc/passwd')",
        "x",
        "1 if 1 else 2",
        "9**99999",
        "[1]",
    ],
)
def test_calculator_refuses_anything_but_arithmetic(expression: str) -> None:
    with pytest.raises(ToolError):
        calculator(expression)


def test_current_time_rejects_unknown_zones() -> None:
    assert current_time("Europe/Paris").endswith(("+01:00", "+02:00"))
    with pytest.raises(ToolError):
        current_time("Mars/Olympus")


def test_arguments_are_validated_against_the_signature() -> None:
    load()
    tool = get_tool("calculator")
    assert tool.parameters_schema["required"] == ["expression"]
    with pytest.raises(ToolArgumentsInvalid, match="expression"):
        tool.validate_arguments({})
    with pytest.raises(ToolArgumentsInvalid, match="bogus: Extra inputs"):
        tool.validate_arguments({"expression": "1", "bogus": 2})
    with pytest.raises(ToolArgumentsInvalid):
        tool.validate_arguments(["not", "an", "object"])


def test_context_parameter_is_hidden_from_the_model_and_json_keeps_its_name() -> None:
    load()
    schema = get_tool("http_request").parameters_schema
    assert "context" not in schema["properties"]
    assert "json" in schema["properties"]


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
    from dataclasses import replace

    slow = replace(get_tool("sleep"), timeout=0.1)
    outcome = tool_runner.execute(slow, {"seconds": 2}, CONTEXT)
    assert not outcome.ok
    assert "timed out" in (outcome.error or "")
