"""Each provider's structured-output mode: OpenAI's response_format (strict only when the
schema qualifies), Anthropic's output tool (its input the answer)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from workers.providers import structured
from workers.providers.base import ModelRequest, ModelResponse, ToolCallRequest, ToolSchema

CLOSED = {
    "type": "object",
    "properties": {
        "total": {"type": "number", "minimum": 0},
        "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["total", "lines", "note"],
    "additionalProperties": False,
    "$defs": {
        "line": {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
            "additionalProperties": False,
        }
    },
}


def _with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    schema = json.loads(json.dumps(CLOSED))
    node = schema
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return dict(schema)


def test_a_closed_schema_is_strict() -> None:
    assert structured.response_format(CLOSED) == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": CLOSED, "strict": True},
    }


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array", "items": {"type": "string"}},  # not an object at the root
        _with(("additionalProperties",), True),
        _with(("required",), ["total"]),
        _with(("$defs", "line", "additionalProperties"), True),
        _with(("properties", "total", "minLength"), 1),  # a keyword strict mode leaves out
        _with(("properties", "note", "oneOf"), [{"type": "string"}]),
    ],
)
def test_a_schema_strict_mode_cannot_take_is_not_strict(schema: dict[str, Any]) -> None:
    assert structured.response_format(schema)["json_schema"]["strict"] is False


def test_the_schemas_title_names_it_as_openai_allows() -> None:
    spec = structured.response_format({"title": "Receipt total (EUR)", "type": "number"})
    assert spec["json_schema"]["name"] == "Receipt_total__EUR_"


def _request(
    schema: dict[str, Any] | None, *, tools: tuple[str, ...] = (), **options: Any
) -> ModelRequest:
    return ModelRequest(
        task_id="t",
        step=1,
        model="claude",
        messages=[],
        tools=[ToolSchema(name, "", {"type": "object"}) for name in tools],
        options=options,
        output_schema=schema,
    )


def test_with_no_other_tool_the_output_tool_is_forced() -> None:
    tools: list[dict[str, Any]] = []
    options: dict[str, Any] = {}
    tool = structured.for_anthropic(_request(CLOSED), tools, options)
    assert tool is not None
    assert tools == [
        {
            "name": "final_answer",
            "description": structured.OUTPUT_TOOL_DESCRIPTION,
            "input_schema": CLOSED,
        }
    ]
    assert options == {"tool_choice": {"type": "tool", "name": "final_answer"}}


@pytest.mark.parametrize(
    ("options", "choice"),
    [
        ({}, {"type": "any"}),
        ({"tool_choice": {"type": "auto"}}, {"type": "auto"}),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, None),
    ],
)
def test_beside_other_tools_any_tool_is_forced_unless_the_task_chose_or_thinks(
    options: dict[str, Any], choice: dict[str, Any] | None
) -> None:
    tools = [{"name": "final_answer"}]
    sent = {k: v for k, v in options.items() if k == "tool_choice"}
    tool = structured.for_anthropic(
        _request(CLOSED, tools=("final_answer",), **options), tools, sent
    )
    assert tool is not None
    assert tool.name == "final_answer_"  # named apart from the task's
    assert sent.get("tool_choice") == choice


def test_no_schema_no_output_tool() -> None:
    tools: list[dict[str, Any]] = []
    assert structured.for_anthropic(_request(None), tools, {}) is None
    assert tools == []


def test_the_output_tools_input_is_the_answer() -> None:
    tool = structured.output_tool(CLOSED, [])
    call = ToolCallRequest("toolu_1", "final_answer", {"total": 1})
    answered = tool.answer(ModelResponse(content="Here it is.", tool_calls=[call]))
    assert (answered.content, answered.tool_calls) == ('{"total": 1}', [])


def test_beside_a_real_tool_call_the_output_call_waits_for_its_result() -> None:
    tool = structured.output_tool(CLOSED, [])
    real = ToolCallRequest("toolu_1", "calculator", {"expression": "1+1"})
    mine = ToolCallRequest("toolu_2", "final_answer", {"total": 2})
    assert tool.answer(ModelResponse(content=None, tool_calls=[real, mine])).tool_calls == [real]


def test_malformed_output_input_is_the_answer_as_sent() -> None:
    tool = structured.output_tool(CLOSED, [])
    call = ToolCallRequest("toolu_1", "final_answer", {}, invalid_arguments='{"total": ')
    assert tool.answer(ModelResponse(content=None, tool_calls=[call])).content == '{"total": '


def test_a_schema_that_is_no_object_is_wrapped_and_unwrapped() -> None:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "array",
        "items": {"$ref": "#/$defs/w"},
        "$defs": {"w": {"type": "string"}},
    }
    tool = structured.output_tool(schema, [])
    assert tool.wrapped
    assert tool.definition(schema)["input_schema"] == {
        "type": "object",
        "properties": {"output": {"type": "array", "items": {"$ref": "#/$defs/w"}}},
        "required": ["output"],
        "$defs": {"w": {"type": "string"}},
    }
    call = ToolCallRequest("toolu_1", "final_answer", {"output": ["a"]})
    assert tool.answer(ModelResponse(content=None, tool_calls=[call])).content == '["a"]'


def test_the_draft_is_not_sent_to_the_provider() -> None:
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema"} | CLOSED
    assert structured.response_format(schema)["json_schema"]["schema"] == CLOSED
    assert structured.response_format(schema)["json_schema"]["strict"] is True


def test_the_output_tool_is_named_apart_from_the_tools_as_they_go_out() -> None:
    tools = [
        ToolSchema("final.answer", "", {"type": "object"}),
        ToolSchema("final__answer", "", {}),
    ]
    assert structured.output_tool(CLOSED, tools).name == "final_answer"
    assert (
        structured.output_tool(CLOSED, [ToolSchema("final_answer", "", {})]).name == "final_answer_"
    )
