"""Asking a provider for an answer that meets a task's output schema, in its own mode.

- **OpenAI-compatible**: ``response_format: {"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}``. ``strict`` is true only for a schema OpenAI's strict mode accepts
  whole (``strict_qualifies``): every object closed (``additionalProperties: false``) with all
  its properties required, and no keyword strict mode leaves out. Otherwise it is false: the
  schema still guides the model, and the answer is validated all the same (``$schema`` is
  left out of what is sent: the draft is Ratchet's to know). A task's own
  ``model_options.response_format`` is sent instead, if it gives one (for a server that knows
  only ``json_object``, say).
- **Anthropic**: a tool whose input is the answer (``final_answer``), offered with the task's
  own tools. ``tool_choice`` makes the model use a tool on every turn (``any``; with no other
  tool, that one), so it may call its tools first and ends by calling this one; the call's
  input is the answer, and the call itself never reaches the ledger. A schema whose root is no
  object is wrapped as ``{"output": …}`` (a tool's input is an object) and unwrapped again.
  With extended thinking on, or a ``tool_choice`` of the task's own, the choice is left to
  the model (the API forces no tool while thinking): an answer in text is validated too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from workers.providers.base import ModelRequest, ModelResponse, ToolSchema, wire_name

OUTPUT_TOOL = "final_answer"
OUTPUT_TOOL_DESCRIPTION = (
    "Give your final answer with this tool once you have it: its input is the answer, in the "
    "shape the task requires. Call the other tools first if you need them."
)
WRAPPED = "output"

# Keywords OpenAI's strict mode takes (besides the structure checked below); any other keyword
# anywhere makes the schema non-strict.
STRICT_KEYWORDS = frozenset(
    {
        *("type", "properties", "required", "additionalProperties", "items", "anyOf", "enum"),
        *("const", "$ref", "$defs", "definitions", "description", "title", "$schema"),
        *("pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
        *("multipleOf", "minItems", "maxItems"),
    }
)


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    """The ``response_format`` of a chat completion that must meet ``schema``."""
    title = re.sub(r"[^a-zA-Z0-9_-]", "_", str(schema.get("title") or ""))[:64]
    spec = {"name": title or "output", "schema": _plain(schema), "strict": strict_qualifies(schema)}
    return {"type": "json_schema", "json_schema": spec}


def strict_qualifies(schema: dict[str, Any]) -> bool:
    """Whether OpenAI's strict mode takes ``schema`` as it is: an object at the root, every
    object closed with all its properties required, only keywords strict mode knows."""
    return schema.get("type") == "object" and _strict(schema)


def _strict(node: Any) -> bool:
    if not isinstance(node, dict) or not set(node) <= STRICT_KEYWORDS:
        return False
    if node.get("type") == "object" or "properties" in node:
        properties = node.get("properties", {})
        if node.get("additionalProperties") is not False:
            return False
        if not isinstance(properties, dict) or set(node.get("required", [])) != set(properties):
            return False
    children = [
        *(node.get("properties") or {}).values(),
        *(node.get("$defs") or {}).values(),
        *(node.get("definitions") or {}).values(),
        *(node.get("anyOf") or []),
        *([node["items"]] if "items" in node else []),
    ]
    return all(_strict(child) for child in children)


@dataclass(frozen=True)
class OutputTool:
    """The tool an Anthropic model answers with: its name (not one of the task's tools) and
    whether its input wraps the answer as ``{"output": …}``."""

    name: str
    wrapped: bool

    def definition(self, schema: dict[str, Any]) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": OUTPUT_TOOL_DESCRIPTION,
            "input_schema": _object_schema(schema) if self.wrapped else _plain(schema),
        }

    def tool_choice(self, *, other_tools: bool) -> dict[str, Any]:
        return {"type": "any"} if other_tools else {"type": "tool", "name": self.name}

    def answer(self, response: ModelResponse) -> ModelResponse:
        """The response with a call of this tool as its final answer: the call's input (as
        JSON text) becomes the content. Called beside the task's own tools, it is dropped:
        those run first, and the model answers again after them."""
        mine = [c for c in response.tool_calls if c.name == self.name]
        if not mine:
            return response
        others = [c for c in response.tool_calls if c.name != self.name]
        if others:
            return replace(response, tool_calls=others)
        call = mine[0]
        if call.invalid_arguments is not None:
            return replace(response, content=call.invalid_arguments, tool_calls=[])
        value = call.arguments.get(WRAPPED) if self.wrapped else call.arguments
        return replace(response, content=json.dumps(value), tool_calls=[])


def output_tool(schema: dict[str, Any], tools: list[ToolSchema]) -> OutputTool:
    """The output tool for ``schema`` among ``tools`` (named apart from each of them)."""
    taken = {wire_name(t.name) for t in tools}  # as the tools go out
    name = OUTPUT_TOOL
    while name in taken:
        name += "_"
    return OutputTool(name, wrapped=schema.get("type") != "object")


def _plain(schema: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in schema.items() if k != "$schema"}


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``{"output": schema}`` as an object schema; the schema's definitions move to the root,
    where its ``#/$defs/…`` references look for them."""
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    inner = {k: v for k, v in schema.items() if k not in defs and k != "$schema"}
    wrapper = {"type": "object", "properties": {WRAPPED: inner}, "required": [WRAPPED]}
    return wrapper | defs


def for_anthropic(
    request: ModelRequest, tools: list[dict[str, Any]], options: dict[str, Any]
) -> OutputTool | None:
    """For a request with an output schema: the output tool, added to ``tools`` (the wire's),
    and the ``tool_choice`` that makes the model use a tool, set in ``options`` unless the
    task chose one or thinks."""
    schema = request.output_schema
    if schema is None:
        return None
    tool = output_tool(schema, request.tools)
    tools.append(tool.definition(schema))
    thinking = request.options.get("thinking")
    thinks = isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled")
    if "tool_choice" not in options and not thinks:
        options["tool_choice"] = tool.tool_choice(other_tools=bool(request.tools))
    return tool
