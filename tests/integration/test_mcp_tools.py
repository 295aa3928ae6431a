"""MCP servers as tools, against real servers built with the SDK: one started over stdio as a
child of this process, one over Streamable HTTP on a loopback port. A task uses both in one
conversation; each call goes through the ledger with its idempotency key in ``_meta``; the
servers' annotations decide approval and idempotency; a server that is down, slow or crashes
is a tool error the model reads and the task goes on; a stdio server is started once per
process, and again after it died."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from benchmarks.harness.processes import free_port
from shared.agents.registry import Agent, get_registry, register_agent
from shared.errors import ToolError
from shared.mcp import connections
from shared.mcp.catalog import McpTool, resolve
from shared.mcp.config import current
from tests.conftest import Configure, TenantHandle
from tests.fakes.mcp_servers.http_server import HttpServer
from tests.fakes.mcp_servers.toolset import PIXEL, Record
from tests.fakes.openai_server import OpenAIServer, answer, tool_call
from tests.helpers import scripted_task, tool_turn

ROOT = Path(__file__).resolve().parents[2]
# A stdio server is a Python process importing the SDK: on a busy machine it takes seconds.
START_SECONDS = 30
SLOW_TIMEOUT_SECONDS = 3


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    with HttpServer(tmp_path_factory.mktemp("web"), free_port()) as server:
        yield server


@pytest.fixture
def servers(
    backend_env: dict[str, str], web: HttpServer, tmp_path: Path, configure: Configure
) -> Iterator[Callable[..., Record]]:
    """Declare the test servers (``files``: stdio, recording to a directory of this test;
    ``web``: HTTP; ``down``: HTTP where nothing listens; ``slow``: ``web`` with a 3 s
    timeout), with ``extra`` fields merged into ``files``; returns the stdio server's record.
    Every session of this process is closed after the test (the stdio children exit)."""
    records = tmp_path / "files"
    records.mkdir()

    def declare(**extra: Any) -> Record:
        files = {
            "command": sys.executable,
            "args": ["-m", "tests.fakes.mcp_servers.stdio_server"],
            "cwd": str(ROOT),
            "env": {"MCP_FAKE_DIR": str(records)},
            "timeout_seconds": START_SECONDS,
        } | extra
        declared = {
            "files": files,
            "web": {"url": web.url, "timeout_seconds": START_SECONDS},
            "down": {"url": f"http://127.0.0.1:{free_port()}/mcp", "timeout_seconds": 5},
            # Long enough to connect and list on a busy machine, short of the slow tools.
            "slow": {"url": web.url, "timeout_seconds": SLOW_TIMEOUT_SECONDS},
        }
        configure(RATCHET_MCP_SERVERS=json.dumps(declared))
        return Record(records)

    yield declare
    connections.close_all()


def run(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    script: list[dict[str, Any]],
    tools: list[str],
) -> tuple[str, str, list[dict[str, Any]]]:
    """Submit a scripted task with ``tools`` and run it: its id, its status and its calls."""
    answer = client.post(
        "/v1/tasks", json=scripted_task(script, tools=tools), headers=tenant.headers
    )
    assert answer.status_code == 202, answer.text
    task_id = answer.json()["id"]
    status = drive(task_id)
    steps = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()["items"]
    return task_id, status, [call for step in steps for call in step["tool_calls"]]


def test_a_task_uses_a_stdio_and_an_http_server_in_one_conversation(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], servers: Any
) -> None:
    files = servers()
    script = [
        tool_turn("files.add", a=2, b=3),
        tool_turn("web.echo", text="hello over HTTP"),
        tool_turn("files.picture"),
        tool_turn("files.echo", text="hello over stdio"),
        {"content": "done"},
    ]
    task_id, status, calls = run(client, tenant, drive, script, ["files.*", "web.echo"])
    assert status == "succeeded"
    assert [(c["name"], c["server"], c["status"]) for c in calls] == [
        ("files.add", "files", "succeeded"),
        ("web.echo", "web", "succeeded"),
        ("files.picture", "files", "succeeded"),
        ("files.echo", "files", "succeeded"),
    ]
    # structuredContent as it came; text content as text; an image as an entry.
    assert calls[0]["result"] == {"result": 5}
    assert calls[1]["result"] == "hello over HTTP"
    assert calls[2]["result"] == [{"type": "image", "mime_type": "image/png", "data": PIXEL}]
    # Each call's _meta carried the ledger's idempotency key.
    received = {c["tool"]: c["key"] for c in files.calls()}
    assert received == {
        "add": calls[0]["idempotency_key"],
        "picture": calls[2]["idempotency_key"],
        "echo": calls[3]["idempotency_key"],
    }
    assert calls[0]["idempotency_key"] == f"{task_id}:{calls[0]['call_id']}"
    # The API and the steps ran in this process: the stdio server started once for all.
    assert connections.starts("files") == 1
    assert len(files.starts()) == 1


def test_the_http_server_received_the_key_in_meta(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    servers: Any,
    web: HttpServer,
) -> None:
    servers()
    script = [tool_turn("web.upsert", key="k1"), {"content": "done"}]
    _, status, calls = run(client, tenant, drive, script, ["web.*"])
    assert status == "succeeded"
    [call] = calls
    assert call["result"] == {"upserted": "k1"}
    sent = [c for c in Record(web.directory).calls("upsert") if c["arguments"] == {"key": "k1"}]
    assert [c["key"] for c in sent] == [call["idempotency_key"]]


def test_a_server_that_is_down_or_fails_is_a_tool_error_and_the_task_goes_on(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], servers: Any
) -> None:
    servers()
    script = [
        tool_turn("down.anything", x=1),
        tool_turn("files.fail"),
        tool_turn("files.add", a="not a number", b=1),
        {"content": "carried on"},
    ]
    _, status, calls = run(client, tenant, drive, script, ["down.anything", "files.*"])
    assert status == "succeeded"
    assert [c["status"] for c in calls] == ["failed"] * 3
    assert "MCP server 'down'" in calls[0]["error"]
    assert calls[1]["error"].endswith("the tool failed on purpose")  # isError: the server's text
    assert "validation error" in calls[2]["error"]


def test_a_slow_server_is_cut_at_its_timeout_and_the_model_reads_why(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], servers: Any
) -> None:
    servers()
    script = [
        tool_turn("slow.slow_read", seconds=60),
        tool_turn("slow.slow_write", seconds=60),
        {"content": "carried on"},
    ]
    _, status, calls = run(client, tenant, drive, script, ["slow.*"])
    assert status == "succeeded"
    read, write = calls
    assert read["status"] == "failed"
    assert f"did not answer slow_read within {SLOW_TIMEOUT_SECONDS} s" in read["error"]
    # A non-idempotent call that got no answer may still act: the unknown-outcome policy
    # (tell_model, MCP's default) says so to the model, and it is not run again.
    assert write["status"] == "failed"
    assert "outcome is unknown" in write["error"]
    assert write["runs"] == 1


def test_a_crashed_stdio_server_is_restarted_for_the_next_call(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], servers: Any
) -> None:
    files = servers()
    script = [
        tool_turn("files.echo", text="before"),
        tool_turn("files.crash"),
        tool_turn("files.echo", text="after"),
        {"content": "done"},
    ]
    _, status, calls = run(client, tenant, drive, script, ["files.*"])
    assert status == "succeeded"
    before, crash, after = calls
    assert before["result"] == "before"
    # It died mid-call: the outcome is unknown, the call is not run again.
    assert crash["status"] == "failed"
    assert "went away during the call to crash" in crash["error"]
    assert "outcome is unknown" in crash["error"]
    assert [c["tool"] for c in files.calls()] == ["echo", "crash", "echo"]
    assert after["result"] == "after"
    assert connections.starts("files") == 2
    first, second = files.starts()
    assert first != second


def test_the_tool_list_is_refreshed_when_the_server_says_it_changed(
    backend_env: dict[str, str], servers: Any
) -> None:
    servers()
    before = resolve(["files.*"], agent="default")
    assert "files.added" not in before
    grow = before["files.grow"]
    context = _context("grow")
    assert grow.invoke({"tool": "added"}, context) == {"result": "added added"}
    after = resolve(["files.*"], agent="default")  # well within the TTL
    assert "files.added" in after
    assert after["files.added"].invoke({}, context) == "added ran"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {},
            {
                "files.add": (True, False),  # readOnlyHint
                "files.upsert": (True, False),  # idempotentHint
                "files.delete_file": (False, True),  # destructiveHint
                "files.echo": (False, False),  # nothing said: neither
            },
        ),
        (
            {"delete_file": {"requires_approval": False}, "echo": {"idempotent": True}},
            {"files.delete_file": (False, False), "files.echo": (True, False)},
        ),
    ],
)
def test_annotations_and_overrides_decide_idempotency_and_approval(
    backend_env: dict[str, str],
    servers: Any,
    overrides: dict[str, Any],
    expected: dict[str, tuple[bool, bool]],
) -> None:
    servers(tools=overrides)
    tools = resolve(["files.*"], agent="default")
    found = {name: (tools[name].idempotent, tools[name].needs_approval({})) for name in expected}
    assert found == expected
    assert all(
        isinstance(t, McpTool) and t.on_unknown_outcome == "tell_model" for t in tools.values()
    )


def test_a_destructive_tool_waits_for_approval_and_runs_once_approved(
    client: TestClient,
    make_tenant: Callable[..., TenantHandle],
    drive: Callable[..., str],
    servers: Any,
) -> None:
    files = servers()
    approver = make_tenant(("tasks:read", "tasks:write", "tasks:approve"))
    script = [tool_turn("files.delete_file", path="/tmp/x"), {"content": "done"}]
    task_id, status, _ = run(client, approver, drive, script, ["files.*"])
    assert status == "awaiting_approval"
    assert files.calls("delete_file") == []  # nothing sent before a person decides
    decided = client.post(
        f"/v1/tasks/{task_id}/approvals/1-0", json={"decision": "approve"}, headers=approver.headers
    )
    assert decided.status_code in (200, 202), decided.text
    assert drive(task_id) == "succeeded"
    [sent] = files.calls("delete_file")
    assert sent["key"] == f"{task_id}:1-0"


def test_the_api_checks_mcp_tool_names(
    client: TestClient, tenant: TenantHandle, servers: Any
) -> None:
    servers(agents=["ops"])

    def submit(tools: list[str], agent: str = "default") -> Any:
        body = scripted_task([{"content": "x"}], tools=tools, agent=agent)
        return client.post("/v1/tasks", json=body, headers=tenant.headers)

    refused = {
        "nowhere.*": "unknown MCP server 'nowhere'",
        "web.no_such_tool": "MCP server 'web' has no tool 'no_such_tool'",
        "files.*": "MCP server 'files' is not available to agent 'default'",
    }
    for name, reason in refused.items():
        answer = submit([name])
        assert answer.status_code == 422, answer.text
        assert reason in answer.text
    # A declared server that cannot be listed now is taken on trust.
    assert submit(["down.whatever", "web.echo", "web.*"]).status_code == 202
    assert submit(["files.echo"], agent="ops").status_code == 202


def test_the_agents_list_shows_mcp_tools_with_their_schemas_and_server(
    client: TestClient, tenant: TenantHandle, servers: Any
) -> None:
    servers()
    register_agent(Agent(name="mcp-tester", tools=("calculator", "web.*", "files.echo")))
    try:
        answer = client.get("/v1/agents", headers=tenant.headers, params={"limit": 200})
    finally:
        get_registry().agents.pop("mcp-tester")
    assert answer.status_code == 200, answer.text
    [agent] = [a for a in answer.json()["items"] if a["name"] == "mcp-tester"]
    tools = {t["name"]: t for t in agent["tools"]}
    assert tools["calculator"]["server"] is None
    assert tools["web.add"]["server"] == "web"
    assert tools["web.add"]["idempotent"] is True
    assert tools["web.add"]["parameters"]["properties"]["a"]["type"] == "integer"
    assert tools["web.delete_file"]["requires_approval"] is True
    assert tools["files.echo"]["server"] == "files"
    assert "files.add" not in tools  # only what the agent names


def test_the_egress_policy_decides_for_http_servers(
    backend_env: dict[str, str], servers: Any, configure: Configure
) -> None:
    servers()
    configure(RATCHET_HTTP_ALLOWED_HOSTS="example.com")
    with pytest.raises(ToolError, match=r"resolves to a non-public address \(127\.0\.0\.1\)"):
        connections.list_tools("web", config=current()["web"], max_age=0)
    # A call is refused the same way, before anything is sent.
    tool = resolve(["web.echo"], agent="default")["web.echo"]
    with pytest.raises(ToolError, match="non-public"):
        tool.invoke({"text": "x"}, _context("echo"))


def _context(call: str) -> Any:
    from shared.agents.registry import ToolContext

    return ToolContext(task_id="t", tenant_id="x", call_id=call, idempotency_key=f"t:{call}")


def test_an_openai_compatible_model_calls_mcp_tools_by_names_its_api_accepts(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    servers: Any,
    configure: Configure,
) -> None:
    # OpenAI's and Anthropic's APIs take tool names of letters, digits, _ and - only.
    from workers.providers import _provider

    servers()
    with OpenAIServer() as model:
        configure(RATCHET_OPENAI_BASE_URL=model.base_url, RATCHET_OPENAI_API_KEY="test-key")
        _provider.cache_clear()  # its SDK client is made from the settings
        model.reply(
            tool_call("files__add", {"a": 2, "b": 3}),
            tool_call("web__echo", {"text": "hi"}),
            answer("done"),
        )
        body = {"input": "add", "model": "openai:gpt-4o-mini", "tools": ["files.add", "web.*"]}
        answer_ = client.post("/v1/tasks", json=body, headers=tenant.headers)
        assert answer_.status_code == 202, answer_.text
        task_id = answer_.json()["id"]
        assert drive(task_id) == "succeeded"
        first, second, _ = model.requests
    _provider.cache_clear()
    sent = [t["function"]["name"] for t in first.body["tools"]]
    assert "files__add" in sent
    assert "web__echo" in sent
    assert all("." not in name for name in sent)
    [call] = second.messages[-2]["tool_calls"]
    assert call["function"]["name"] == "files__add"
    steps = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()["items"]
    calls = [c for step in steps for c in step["tool_calls"]]
    assert [(c["name"], c["server"], c["result"]) for c in calls] == [
        ("files.add", "files", {"result": 5}),
        ("web.echo", "web", "hi"),
    ]


def test_an_http_server_that_restarted_gets_a_new_session_and_the_call(
    backend_env: dict[str, str], tmp_path: Path, configure: Configure
) -> None:
    with HttpServer(tmp_path, free_port()) as restarting:
        configure(RATCHET_MCP_SERVERS=json.dumps({"again": {"url": restarting.url}}))
        try:
            tool = resolve(["again.echo"], agent="default")["again.echo"]
            assert tool.invoke({"text": "before"}, _context("1")) == "before"
            restarting.stop()
            restarting.start()  # it forgot the session
            assert tool.invoke({"text": "after"}, _context("2")) == "after"
        finally:
            connections.close_all()
    sent = [(c["arguments"]["text"], c["key"]) for c in Record(tmp_path).calls("echo")]
    assert sent == [("before", "t:1"), ("after", "t:2")]  # each once


def test_the_dashboards_task_page_names_the_server_of_each_call(
    client: TestClient,
    make_tenant: Callable[..., TenantHandle],
    drive: Callable[..., str],
    servers: Any,
) -> None:
    servers()
    admin = make_tenant(("tasks:read", "tasks:write", "admin"))
    script = [tool_turn("web.echo", text="hi"), tool_turn("calculator", expression="1+1")]
    tools = ["web.*", "calculator"]
    task_id, status, calls = run(client, admin, drive, [*script, {"content": "done"}], tools)
    assert [c["status"] for c in calls] == ["succeeded", "succeeded"]
    assert status == "succeeded"
    login = client.post("/dashboard/login", data={"key": admin.key}, follow_redirects=False)
    assert login.status_code == 303, login.text
    page = client.get(f"/dashboard/tasks/{task_id}")
    assert page.status_code == 200
    assert page.text.count("MCP server web") == 1  # the calculator call names none
