"""The calculator's evaluator: exact arithmetic, and no expression that holds a core for long.

A big-integer operation holds the interpreter's lock until it returns, so a thread of this
process could not even notice that it overran: the bombs are timed from another process.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from shared.agents.builtin_tools import calculator
from shared.agents.calculator import MAX_BITS, MAX_EXPRESSION_LENGTH
from shared.errors import ToolError

# Each would take from seconds to hours (or all memory) if computed: (9**9999)**1500 froze a
# worker for 22 s, (9**9999)**9999 takes a quarter of an hour.
BOMBS = [
    "(9**9999)**1500",
    "(9**9999)**9999",
    "9**9999**9999",
    "10**10**10",
    "2**2**2**2**2**2",
    "(2**5000)*(2**5000)*(2**5000)",
    "(9**999)*(9**999)*(9**999)*(9**999)*(9**999)*(9**999)*(9**999)*(9**999)",
    "((9**999)**9)**9",
    "(-9**999)**99",
    "round(1, -10**8)",
    "round(2**9999, -99999999)",
    "floor(9**9999)",
    "max(9**9999, 1)",
]
# A generous bound: a refusal takes well under a millisecond, a bomb minutes.
REFUSED_WITHIN_SECONDS = 1.0
# Starting the interpreter and importing the tools, on a busy machine, plus every refusal.
CHILD_TIMEOUT_SECONDS = 60.0

_TIMER = """
import json, sys, time
from shared.agents.builtin_tools import calculator
from shared.errors import ToolError
for expression in json.loads(sys.argv[1]):
    started = time.perf_counter()
    try:
        calculator(expression)
        outcome = "computed"
    except ToolError as exc:
        outcome = str(exc)
    took = time.perf_counter() - started
    print(json.dumps([expression, outcome, took]), flush=True)
"""


def test_every_bomb_is_refused_at_once() -> None:
    try:
        child = subprocess.run(
            [sys.executable, "-c", _TIMER, json.dumps(BOMBS)],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_SECONDS,
            check=True,
            cwd=Path(__file__).resolve().parents[4],  # the checkout, where the product imports from
        )
        lines = child.stdout.splitlines()
    except subprocess.TimeoutExpired as exc:
        done = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout
        raise AssertionError(
            f"the calculator still ran after {CHILD_TIMEOUT_SECONDS} s; finished: {done!r}"
        ) from exc
    results = {expression: (outcome, took) for expression, outcome, took in map(json.loads, lines)}
    assert set(results) == set(BOMBS)
    for expression, (outcome, took) in results.items():
        assert outcome != "computed", expression
        assert took < REFUSED_WITHIN_SECONDS, (expression, took)


ORDINARY: list[tuple[str, object]] = [
    ("2**9999", 2**9999),
    ("3**6000", 3**6000),
    ("-(2**9999) - (2**9999 - 1)", -(2**10000) + 1),
    ("(2**4999)*(2**5000)", 2**9999),
    ("(10**3000)//7 % 1000", (10**3000) // 7 % 1000),
    ("10**3000 / 10**2999", 10.0),
    ("2**-2", 0.25),
    ("round(12345, -2)", 12300),
    ("round(2.675, 2)", 2.67),
    ("round(1.5)", 2),
    ("log(2**9999, 2)", 9999.0),
    ("max(3, 1e308, -2)", 1e308),
    ("min(1, 2) + abs(-3) + ceil(0.5)", 5),
    ("1" * MAX_EXPRESSION_LENGTH, int("1" * MAX_EXPRESSION_LENGTH)),
    ("+".join(["1"] * 250), 250),
    ("(" * 150 + "6*7" + ")" * 150, 42),
]


@pytest.mark.parametrize(
    ("expression", "expected"), ORDINARY, ids=[expression[:30] for expression, _ in ORDINARY]
)
def test_ordinary_expressions_are_computed_exactly(expression: str, expected: object) -> None:
    result = calculator(expression)
    assert result == expected
    assert type(result) is type(expected)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("9**9999", f"exceed {MAX_BITS:,} bits"),
        ("2**10000", f"exceed {MAX_BITS:,} bits"),
        ("1e308*10", "too large for a float"),
        ("1e999", "too large for a float"),
        ("-1e308 - 1e308", "too large for a float"),
        ("exp(1000)", "math range error"),
        ("sqrt(2**9999)", "too large to convert to float"),
        ("(-8)**0.5", "not a real number"),
        ("round(1.5, 0.5)", "must be an integer"),
        ("-" * (MAX_EXPRESSION_LENGTH - 1) + "1", "nests too deeply"),
        ("1" * (MAX_EXPRESSION_LENGTH + 1), f"longer than {MAX_EXPRESSION_LENGTH}"),
        ("0**-1", "cannot be raised to a negative power"),
    ],
)
def test_a_result_past_the_bounds_is_an_error_that_says_why(expression: str, message: str) -> None:
    with pytest.raises(ToolError, match=message.replace("*", r"\*")):
        calculator(expression)


def test_every_value_returned_is_a_finite_number_json_holds() -> None:
    largest = calculator("2**9999 + (2**9999 - 1)")
    assert isinstance(largest, int)
    assert largest.bit_length() == MAX_BITS
    assert json.loads(json.dumps(largest)) == largest
    assert math.isfinite(calculator("1e308 + 1e307"))
