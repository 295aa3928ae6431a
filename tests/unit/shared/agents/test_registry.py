"""The tool registry: arguments are validated against a tool's signature, and what the model
sees of it leaves out the context a tool is given."""

from __future__ import annotations

import pytest

from shared.agents.registry import get_tool, load
from shared.errors import ToolArgumentsInvalid


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
