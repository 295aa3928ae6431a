"""The ``calculator`` tool's evaluator: arithmetic over an expression's syntax tree, never
``eval``, with the work of every operation bounded before it is done.

A big-integer operation runs in C holding the interpreter's lock: ``(9**9999)**9999`` would
stop every thread of its worker process (its other tasks' steps, its heartbeat) for a quarter
of an hour, and a freeze past the lease lets the sweeper run it again on the next process.
So every value stays within :data:`MAX_BITS` (a size JSON and PostgreSQL hold as a number,
well inside Python's integer-to-text limit), an operation whose result would not is refused
from its operands' sizes before it runs, and a float that overflows is an error, not ``inf``.
The expression's length bounds how many operations there are and how deep they nest, so the
whole evaluation takes at most a few milliseconds, whatever the expression.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from shared.errors import ToolError

Number = int | float

MAX_EXPRESSION_LENGTH = 500
# An integer result's size: about 3,000 decimal digits, under Python's 4,300-digit limit on
# converting an integer to text, so any value the calculator returns can be written as JSON.
MAX_BITS = 10_000
MAX_DIGITS = math.ceil(MAX_BITS * math.log10(2))


class _TooLarge(OverflowError):
    """A result past the calculator's bounds."""

    def __init__(self) -> None:
        super().__init__(f"the result would exceed {MAX_BITS:,} bits (about {MAX_DIGITS:,} digits)")


def _bits(value: Number) -> int:
    return value.bit_length() if isinstance(value, int) else 0


def _power(base: Number, exponent: Number) -> Number:
    """``base ** exponent``, refused before it runs when the result would exceed the bound."""
    if isinstance(base, int) and isinstance(exponent, int) and _too_large_power(base, exponent):
        raise _TooLarge
    return operator.pow(base, exponent)  # type: ignore[no-any-return]


def _too_large_power(base: int, exponent: int) -> bool:
    """An integer power has about ``exponent * log2|base|`` bits."""
    if exponent <= 0 or abs(base) <= 1:
        return False
    # Past MAX_BITS the exponent alone says so (|base| >= 2), and it may not fit a float.
    return exponent > MAX_BITS or exponent * math.log2(abs(base)) > MAX_BITS


def _multiply(left: Number, right: Number) -> Number:
    """``left * right``: an integer product has at least ``bits(left) + bits(right) - 1`` bits."""
    if left and right and _bits(left) + _bits(right) - 1 > MAX_BITS:
        raise _TooLarge
    return operator.mul(left, right)  # type: ignore[no-any-return]


def _round(value: Number, digits: int | None = None) -> Number:
    """``round``; rounding an integer to ``-n`` digits computes ``10**n``, so ``n`` is bounded
    (past the bound the answer would not change anyway)."""
    if digits is None:
        return round(value)
    if not isinstance(digits, int):
        raise TypeError("round's digits must be an integer")
    if abs(digits) > MAX_DIGITS:
        raise ValueError(f"round's digits must be between -{MAX_DIGITS} and {MAX_DIGITS}")
    return round(value, digits)


_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: _multiply,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
# Each takes floats (an integer argument past a float's range is an OverflowError) or, like
# abs, floor, ceil, min and max, costs no more than its arguments' size.
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": _round,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "exp": math.exp,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "min": min,
    "max": max,
}
_CONSTANTS: dict[str, Number] = {"pi": math.pi, "e": math.e}


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; raises :class:`ToolError` for anything else,
    for a result past the bounds, and for a float that overflows.

    Invariant: no integer of more than :data:`MAX_BITS` bits is ever computed, and the
    expression is at most :data:`MAX_EXPRESSION_LENGTH` characters, so the work is small.
    """
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise ToolError(f"the expression is longer than {MAX_EXPRESSION_LENGTH} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from exc
    try:
        return _evaluate(tree.body)
    except (ArithmeticError, ValueError, TypeError) as exc:
        raise ToolError(f"cannot evaluate {expression!r}: {exc}") from exc
    except RecursionError as exc:
        raise ToolError(f"cannot evaluate {expression!r}: it nests too deeply") from exc


def _evaluate(node: ast.AST) -> Number:
    return _checked(_value(node))


def _value(node: ast.AST) -> object:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        return _FUNCTIONS[node.func.id](*(_evaluate(arg) for arg in node.args))
    raise ToolError(f"unsupported expression element: {ast.dump(node)[:60]}")


def _checked(value: object) -> Number:
    """Every value, operands included, is a real number within the bounds: an overflowed
    float (``1e308*10``) or a complex power (``(-8)**0.5``) is an error, never a result."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise OverflowError("the result is too large for a float")
        return value
    if isinstance(value, int):
        if value.bit_length() > MAX_BITS:
            raise _TooLarge
        return value
    raise ValueError("the result is not a real number")
