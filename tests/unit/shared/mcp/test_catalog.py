"""MCP tools as Ratchet tools: their schemas, their metadata from annotations and overrides,
and the names a task of an agent may use."""

from __future__ import annotations

import json

import mcp_types as types
import pytest

from shared.agents.registry import ToolContext
from shared.errors import ToolArgumentsInvalid, ToolError
from shared.mcp.catalog import as_tool, problem, resolve
from shared.mcp.config import ServerConfig
from tests.conftest import Configure

SCHEMA = {"type": "object", "title": "x", "properties": {"n": {"type": "integer"}}}
CONTEXT = ToolContext(task_id="t", tenant_id="x", call_id="1-0", idempotency_key="t:1-0")


def listed(name: str, **hints: bool) -> types.Tool:
    annotations = types.ToolAnnotations(**hints) if hints else None  # type: ignore[arg-type]
    return types.Tool(
        name=name, description=f"{name}!", input_schema=SCHEMA, annotations=annotations
    )


@pytest.mark.parametrize(
    ("hints", "overrides", "idempotent", "approval"),
    [
        ({}, {}, False, False),
        ({"readOnlyHint": True}, {}, True, False),
        ({"idempotentHint": True}, {}, True, False),
        ({"destructiveHint": True}, {}, False, True),
        ({"destructiveHint": False, "readOnlyHint": False}, {}, False, False),
        ({"destructiveHint": True}, {"requires_approval": False}, False, False),
        ({"readOnlyHint": True}, {"idempotent": False}, False, False),
        ({}, {"idempotent": True, "requires_approval": True}, True, True),
    ],
)
def test_annotations_then_overrides_decide(
    hints: dict[str, bool], overrides: dict[str, bool], idempotent: bool, approval: bool
) -> None:
    config = ServerConfig(command="x", tools={"t": overrides} if overrides else {})  # type: ignore[arg-type]
    tool = as_tool("srv", config, listed("t", **hints))
    assert (tool.idempotent, tool.needs_approval({})) == (idempotent, approval)


def test_a_tool_carries_the_servers_schema_name_and_timeout() -> None:
    config = ServerConfig(url="https://x.example/mcp", timeout_seconds=7, on_unknown_outcome="ask")
    tool = as_tool("srv", config, listed("count"))
    assert tool.name == "srv.count"
    assert (tool.server, tool.remote_name, tool.description) == ("srv", "count", "count!")
    assert tool.parameters_schema == {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert (tool.timeout or 0) > 7  # the session's own limit comes first
    assert tool.on_unknown_outcome == "ask"
    override = ServerConfig(command="x", tools={"count": {"on_unknown_outcome": "fail"}})  # type: ignore[dict-item]
    assert as_tool("srv", override, listed("count")).on_unknown_outcome == "fail"


def test_arguments_must_be_an_object() -> None:
    tool = as_tool("srv", ServerConfig(command="x"), listed("t"))
    assert tool.validate_arguments({"n": "anything"}) == {"n": "anything"}  # the server checks
    with pytest.raises(ToolArgumentsInvalid, match="must be a JSON object"):
        tool.validate_arguments([1])


def test_names_a_task_may_not_use(configure: Configure) -> None:
    servers = {
        "ops": {"command": "x", "agents": ["ops"]},
        # Nothing listens on port 9: the server cannot be listed, names are taken on trust.
        "down": {"url": "http://127.0.0.1:9/mcp", "timeout_seconds": 2},
    }
    configure(RATCHET_MCP_SERVERS=json.dumps(servers), RATCHET_HTTP_ALLOWED_HOSTS="127.0.0.1")
    assert "unknown MCP server 'nope'" in (problem("nope.*", agent="default") or "")
    assert "declared: down, ops" in (problem("nope.x", agent="default") or "")
    refused = problem("ops.*", agent="default")
    assert refused == "MCP server 'ops' is not available to agent 'default'"
    assert problem("ops.*", agent="ops") is None
    assert problem("down.anything", agent="default") is None


def test_a_server_that_cannot_be_listed_gives_named_tools_that_fail(configure: Configure) -> None:
    down = {"url": "http://127.0.0.1:9/mcp", "timeout_seconds": 2}
    servers = json.dumps({"down": down})
    configure(RATCHET_MCP_SERVERS=servers, RATCHET_HTTP_ALLOWED_HOSTS="127.0.0.1")
    tools = resolve(["down.*", "down.fetch", "nowhere.x", "calculator"], agent="default")
    assert list(tools) == ["down.fetch"]
    with pytest.raises(ToolError, match="MCP server 'down'"):
        tools["down.fetch"].invoke({}, CONTEXT)


def test_a_step_knows_when_resolving_may_wait_for_a_server(configure: Configure) -> None:
    from shared.mcp.catalog import may_wait

    configure(RATCHET_MCP_SERVERS=json.dumps({"ops": {"command": "x", "agents": ["ops"]}}))
    assert may_wait(["calculator", "ops.*"], agent="ops")  # never listed in this process
    assert not may_wait(["calculator", "ops.*"], agent="default")  # not its server
    assert not may_wait(["calculator", "nowhere.*"], agent="ops")
