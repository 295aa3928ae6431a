"""The built-in tools: the calculator does arithmetic and nothing else; the clock knows its
zones."""

from __future__ import annotations

import pytest

from shared.agents.builtin_tools import calculator, current_time
from shared.errors import ToolError


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
