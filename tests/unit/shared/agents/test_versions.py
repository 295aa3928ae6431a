"""Agent versions without a database: what a definition holds, that its id depends on nothing
else, and how a pinned tool behaves around this deployment's code."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from shared.agents import versions
from shared.agents.registry import Agent, Tool, ToolContext, get_tool, load, tool
from shared.errors import ToolError


def _context() -> ToolContext:
    return ToolContext(task_id="t", tenant_id="n", call_id="1-0", idempotency_key="t:1-0")


def test_every_field_of_an_agent_and_a_tool_is_pinned_or_left_out_on_purpose() -> None:
    """A field added to Agent or Tool must be put in a version, or named as left out: a new
    behaviour a deploy could change under a running task fails here first."""
    agent_fields = {f.name for f in dataclasses.fields(Agent)}
    assert agent_fields == {"name", "tools", *versions.AGENT_FIELDS, *versions.AGENT_NOT_PINNED}
    tool_fields = {f.name for f in dataclasses.fields(Tool)}
    assert tool_fields == {"name", *versions.TOOL_FIELDS, *versions.TOOL_CODE}


def test_the_id_is_the_hash_of_the_definition_alone() -> None:
    load()
    calculator = get_tool("calculator")
    agent = Agent(name="a", system_prompt="p", tools=("calculator", "time.*"))
    definition = versions.definition_of(agent, {"calculator": calculator})
    assert definition["tools"][1] == {"name": "time.*"}  # an MCP tool: its name
    assert definition["tools"][0]["parameters"] == calculator.parameters_schema
    reordered = dict(reversed(list(definition.items())))
    assert versions.version_id(reordered) == versions.version_id(definition)
    described = Agent(name="a", system_prompt="p", tools=agent.tools, description="shown only")
    assert versions.definition_of(described, {"calculator": calculator}) == definition
    changed = dataclasses.replace(agent, system_prompt="q")
    other = versions.version_id(versions.definition_of(changed, {"calculator": calculator}))
    assert other != versions.version_id(definition)


def _pinned_spec(**changes: Any) -> dict[str, Any]:
    load()
    return versions.tool_definition(get_tool("calculator")) | changes


def test_a_pinned_tool_is_described_as_pinned_and_runs_the_deployed_code() -> None:
    spec = _pinned_spec(description="As it was.", parameters={"type": "object"}, timeout=3.0)
    pinned = versions.pinned_tool(get_tool("calculator"), spec)
    assert pinned.description == "As it was."
    assert pinned.parameters_schema == {"type": "object"}
    assert pinned.timeout == 3.0
    assert pinned.invoke({"expression": "6*7"}, _context()) == 42


def test_a_pinned_approval_predicate_is_the_deployed_one_or_always_asks() -> None:
    @tool(name="versions_test_refund", requires_approval=lambda args: args["amount"] > 5)
    def refund(amount: int) -> str:
        return "ok"

    predicate = load().tools.pop("versions_test_refund")  # kept out of the registry
    spec = versions.tool_definition(predicate)
    assert spec["requires_approval"] == versions.PREDICATE
    assert versions.pinned_tool(predicate, spec).needs_approval({"amount": 1}) is False
    now_plain = dataclasses.replace(predicate, requires_approval=False)
    assert versions.pinned_tool(now_plain, spec).needs_approval({"amount": 1}) is True


def test_a_removed_tool_refuses_every_call_and_says_why() -> None:
    spec = _pinned_spec(name="gone", requires_approval=True, idempotent=False)
    gone = versions.unavailable_tool(spec)
    assert gone.parameters_schema == spec["parameters"]
    assert gone.needs_approval({}) is False  # nothing runs: nothing to approve
    assert gone.idempotent  # nothing ran: a crash leaves no unknown outcome
    with pytest.raises(ToolError, match=r"'gone' is not available in this deployment"):
        gone.invoke({"expression": "1"}, _context())


def test_a_version_written_before_a_field_existed_still_runs() -> None:
    """A row keeps the fields of the release that wrote it: a field added since is absent,
    and its default (or the deployed tool's value) holds."""
    spec = _pinned_spec()
    del spec["max_result_chars"], spec["on_unknown_outcome"]
    definition = {"name": "a", "system_prompt": "p", "tools": [spec]}
    version = versions.Version("old", "a", definition)
    assert version.pinned_agent.output_schema is None
    assert version.pinned_agent.system_prompt == "p"
    pinned = versions.pinned_tools(version, ["calculator"])["calculator"]
    assert pinned.on_unknown_outcome == get_tool("calculator").on_unknown_outcome
    assert versions.unavailable_tool(spec).max_result_chars is None
