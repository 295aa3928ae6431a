"""An output schema is checked where it enters, and an answer is judged against it in words
the model can act on."""

from __future__ import annotations

from typing import Any

import pytest

from shared.errors import InvalidRequest
from shared.output_schema import check_schema, problem

RECEIPT = {
    "type": "object",
    "properties": {"total": {"$ref": "#/$defs/money"}, "currency": {"type": "string"}},
    "required": ["total", "currency"],
    "$defs": {"money": {"type": "number", "minimum": 0}},
}


@pytest.mark.parametrize(
    "schema",
    [
        RECEIPT,
        {"type": "array", "items": {"type": "string"}},
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "definitions": {"a": {}},
            "$ref": "#/definitions/a",
        },
        {},
    ],
)
def test_a_valid_schema_passes(schema: dict[str, Any]) -> None:
    check_schema(schema, max_bytes=65_536)


@pytest.mark.parametrize(
    ("schema", "field", "reason"),
    [
        ("a string", "output_schema", "must be a JSON Schema object"),
        ({"type": "nope"}, "output_schema.type", "is not valid under any of the given schemas"),
        ({"required": "total"}, "output_schema.required", "is not of type 'array'"),
        ({"$ref": "other.json"}, "output_schema.$ref", "only references inside the schema"),
        ({"anyOf": [{"$ref": "#/$defs/x"}]}, "output_schema.anyOf[0].$ref", "points at nothing"),
        (
            {"$schema": "https://example.com/mine"},
            "output_schema.$schema",
            "unknown JSON Schema draft",
        ),
        ({"description": "x" * 2000}, "output_schema", "at most 1024"),
    ],
)
def test_a_bad_schema_is_refused_naming_where(schema: Any, field: str, reason: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_schema(schema, max_bytes=1024)
    assert refused.value.field == field
    assert reason in refused.value.reason


def test_an_answer_that_meets_the_schema_is_parsed() -> None:
    assert problem(RECEIPT, '{"total": 12.5, "currency": "EUR"}') == (
        {"total": 12.5, "currency": "EUR"},
        None,
    )


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (None, "the answer is not JSON"),
        ("twelve", "the answer is not JSON"),
        ('{"total": -1, "currency": "EUR"}', "the answer.total: -1 is less than the minimum of 0"),
        ('{"total": 1}', "the answer: 'currency' is a required property"),
        ("[1]", "the answer: [1] is not of type 'object'"),
    ],
)
def test_an_answer_that_misses_says_what_and_where(text: str | None, said: str) -> None:
    _, error = problem(RECEIPT, text)
    assert error is not None
    assert said in error


def test_every_error_of_an_answer_is_said_at_once_and_each_is_short() -> None:
    _, error = problem(RECEIPT, '{"total": "' + "9" * 5000 + '"}')
    assert error is not None
    assert "'currency' is a required property" in error
    assert "is not of type 'number'" in error
    assert len(error) < 1300


def test_a_bad_schema_is_refused_every_time_and_a_good_one_checked_once() -> None:
    for _ in range(2):
        with pytest.raises(InvalidRequest):
            check_schema({"type": "nope"}, max_bytes=1024)
    check_schema({"type": "integer", "minimum": 3}, max_bytes=1024)
    check_schema({"minimum": 3, "type": "integer"}, max_bytes=1024)  # the same, keys in any order
    with pytest.raises(InvalidRequest, match="at most 10"):
        check_schema({"type": "integer", "minimum": 3}, max_bytes=10)  # the size, every time
