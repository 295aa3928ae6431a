"""A tenant's own MCP servers, against a real Streamable HTTP server built with the SDK: a
tenant registers one whose header names its secret, its task calls a tool of it (the server
sees the header with the secret in it, the ledger never does), another tenant can neither
see, remove nor name it, and a URL the egress policy refuses, a name the operator declares or
bad headers are refused, storing nothing."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from benchmarks.harness.processes import free_port
from shared.mcp import connections
from shared.store import audit
from shared.store.db import transaction
from shared.store.tables import TenantMcpServer, ToolCall
from shared.vault import new_key
from tests.conftest import Configure, TenantHandle
from tests.fakes.mcp_servers.http_server import HttpServer
from tests.fakes.mcp_servers.toolset import Record
from tests.helpers import scripted_task, tool_turn
from tests.integration.test_api import assert_problem

pytestmark = pytest.mark.backends("postgresql", "sqlite")

PATH = "/v1/mcp-servers"
TOKEN = "mcp-tok-8b2e41d07a9c4f3b-secret"
START_SECONDS = 30


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    with HttpServer(tmp_path_factory.mktemp("tenant-web"), free_port()) as server:
        yield server


@pytest.fixture
def keyed(configure: Configure) -> Iterator[Configure]:
    configure(RATCHET_SECRETS_KEY=new_key())
    yield configure
    connections.close_all()


@pytest.fixture
def admin(make_tenant: Callable[..., TenantHandle]) -> TenantHandle:
    return make_tenant(("admin",))


def register(client: TestClient, tenant: TenantHandle, **body: Any) -> Any:
    return client.post(PATH, json=body, headers=tenant.headers)


def registered(client: TestClient, tenant: TenantHandle, url: str, **extra: Any) -> dict[str, Any]:
    body = {
        "name": "mine",
        "url": url,
        "headers": {"Authorization": "Bearer ${secret:MCP_TOKEN}", "X-Team": "blue"},
        "timeout_seconds": START_SECONDS,
    } | extra
    answer = register(client, tenant, **body)
    assert answer.status_code == 201, answer.text
    created: dict[str, Any] = answer.json()
    return created


def set_secret(client: TestClient, tenant: TenantHandle, name: str, value: str) -> None:
    answer = client.put(f"/v1/secrets/{name}", json={"value": value}, headers=tenant.headers)
    assert answer.status_code in (200, 201), answer.text


def submit(client: TestClient, tenant: TenantHandle, tools: list[str], script: Any) -> Any:
    return client.post("/v1/tasks", json=scripted_task(script, tools=tools), headers=tenant.headers)


def stored(tenant_id: str) -> list[TenantMcpServer]:
    with transaction() as session:
        rows = session.scalars(
            select(TenantMcpServer).where(TenantMcpServer.tenant_id == tenant_id)
        ).all()
        session.expunge_all()
    return list(rows)


def test_a_tenants_task_calls_its_own_server_with_the_secret_in_its_header(
    client: TestClient,
    admin: TenantHandle,
    keyed: Configure,
    web: HttpServer,
    drive: Callable[..., str],
) -> None:
    set_secret(client, admin, "MCP_TOKEN", TOKEN)
    created = registered(client, admin, web.url)
    assert created["header_names"] == ["Authorization", "X-Team"]
    assert "Bearer" not in json.dumps(created)
    listed = client.get(PATH, headers=admin.headers).json()["items"]
    assert [s["id"] for s in listed] == [created["id"]]
    assert "Bearer" not in json.dumps(listed)
    # Stored encrypted: neither the header nor (of course) the secret is in clear.
    [row] = stored(admin.id)
    assert row.headers_ciphertext is not None
    assert "Bearer" not in row.headers_ciphertext

    script = [
        tool_turn("mine.add", a=2, b=3),
        tool_turn("mine.echo", text=f"the token is {TOKEN}"),  # the server echoes it back
        {"content": "done"},
    ]
    answer = submit(client, admin, ["mine.*"], script)
    assert answer.status_code == 202, answer.text
    task_id = answer.json()["id"]
    assert drive(task_id) == "succeeded"

    calls = Record(web.directory).calls()
    mine = [c for c in calls if c["key"] and c["key"].startswith(task_id)]
    assert [(c["tool"], c["authorization"]) for c in mine] == [
        ("add", f"Bearer {TOKEN}"),
        ("echo", f"Bearer {TOKEN}"),
    ]
    steps = client.get(f"/v1/tasks/{task_id}/steps", headers=admin.headers).json()["items"]
    outcomes = [(c["name"], c["status"], c["result"]) for s in steps for c in s["tool_calls"]]
    assert outcomes == [
        ("mine.add", "succeeded", {"result": 5}),
        ("mine.echo", "succeeded", "the token is [secret:MCP_TOKEN]"),
    ]
    with transaction() as session:
        results = [c.result for c in session.scalars(select(ToolCall)).all()]
    assert TOKEN not in json.dumps(results)


def test_another_tenant_cannot_see_remove_or_name_the_server(
    client: TestClient,
    make_tenant: Callable[..., TenantHandle],
    keyed: Configure,
    web: HttpServer,
) -> None:
    owner, other = make_tenant(("admin",)), make_tenant(("admin",))
    set_secret(client, owner, "MCP_TOKEN", TOKEN)
    created = registered(client, owner, web.url)

    assert client.get(PATH, headers=other.headers).json()["items"] == []
    assert_problem(client.delete(f"{PATH}/{created['id']}", headers=other.headers), 404)
    for tools in (["mine.echo"], ["mine.*"]):
        refused = assert_problem(submit(client, other, tools, [{"content": "x"}]), 422)
        assert "unknown MCP server 'mine'" in refused["detail"]
    assert len(stored(owner.id)) == 1

    # The other tenant may use the same name for a server of its own: names are per tenant.
    registered(client, other, web.url, headers={})
    assert submit(client, other, ["mine.echo"], [{"content": "x"}]).status_code == 202


def test_removed_a_server_is_no_longer_named_and_each_change_is_audited(
    client: TestClient, admin: TenantHandle, keyed: Configure, web: HttpServer
) -> None:
    created = registered(client, admin, web.url, headers={})
    assert client.delete(f"{PATH}/{created['id']}", headers=admin.headers).status_code == 204
    assert_problem(client.delete(f"{PATH}/{created['id']}", headers=admin.headers), 404)
    assert_problem(submit(client, admin, ["mine.*"], [{"content": "x"}]), 422)
    with transaction() as session:
        entries = [(e.action, e.target) for e in audit.list_for(session, admin.id)]
    assert entries == [("mcp_server.remove", "mine"), ("mcp_server.add", "mine")]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "http://169.254.169.254/mcp"}, "url"),  # cloud metadata
        ({"url": "http://10.1.2.3/mcp"}, "url"),  # private
        ({"url": "http://[::1]:8080/mcp"}, "url"),  # loopback, not allow-listed
        ({"url": "file:///etc/passwd"}, "url"),
        ({"name": "Has Space"}, "name"),
        ({"name": "web"}, "name"),  # the operator's
        ({"headers": {"Bad Header": "x"}}, "headers.Bad Header"),
        ({"headers": {"X-Token": "${secret:lower}"}}, "headers.X-Token"),
        ({"headers": {"X-Token": "a\r\nInjected: yes"}}, "headers.X-Token"),
        ({"command": "python"}, "command"),  # no stdio: a tenant never starts a process
    ],
)
def test_refused_registrations_are_422_and_store_nothing(
    client: TestClient,
    admin: TenantHandle,
    keyed: Configure,
    web: HttpServer,
    body: dict[str, Any],
    field: str,
) -> None:
    keyed(RATCHET_MCP_SERVERS=json.dumps({"web": {"url": web.url}}))
    answer = register(client, admin, **({"name": "mine", "url": web.url} | body))
    problem = assert_problem(answer, 422)
    assert field in {error["field"] for error in problem.get("errors", [])}, problem
    assert stored(admin.id) == []


def test_headers_need_a_secrets_key_and_a_server_without_them_does_not(
    client: TestClient, admin: TenantHandle, configure: Configure, web: HttpServer
) -> None:
    configure(RATCHET_SECRETS_KEY=None)
    problem = assert_problem(
        register(client, admin, name="mine", url=web.url, headers={"X-Key": "k"}), 409
    )
    assert "RATCHET_SECRETS_KEY" in problem["detail"]
    assert stored(admin.id) == []
    assert register(client, admin, name="mine", url=web.url).status_code == 201
    assert_problem(register(client, admin, name="mine", url=web.url), 409)  # taken


def test_a_header_naming_a_secret_not_set_makes_its_calls_tool_errors(
    client: TestClient,
    admin: TenantHandle,
    keyed: Configure,
    web: HttpServer,
    drive: Callable[..., str],
) -> None:
    registered(client, admin, web.url)  # MCP_TOKEN never set
    answer = submit(client, admin, ["mine.echo"], [tool_turn("mine.echo", text="hi")])
    assert answer.status_code == 202, answer.text  # taken on trust: it may be set in time
    task_id = answer.json()["id"]
    assert drive(task_id) == "succeeded"
    steps = client.get(f"/v1/tasks/{task_id}/steps", headers=admin.headers).json()["items"]
    [call] = [c for s in steps for c in s["tool_calls"]]
    assert call["status"] == "failed"
    assert "MCP_TOKEN" in call["error"]


def test_rotation_reencrypts_the_headers_too(
    client: TestClient, admin: TenantHandle, configure: Configure, web: HttpServer
) -> None:
    from typer.testing import CliRunner

    from ratchet.cli import app as cli
    from shared.mcp import tenant_servers
    from shared.mcp.config import ServerConfig

    old, new = new_key(), new_key()
    configure(RATCHET_SECRETS_KEY=old)
    set_secret(client, admin, "MCP_TOKEN", TOKEN)
    registered(client, admin, web.url)
    configure(RATCHET_SECRETS_KEY=f"{new},{old}")
    result = CliRunner().invoke(cli, ["secrets", "reencrypt"])
    assert result.exit_code == 0, result.output
    assert "2 re-encrypted" in result.output  # the secret and the server's headers
    configure(RATCHET_SECRETS_KEY=new)  # the old key removed
    [(config, secrets)] = tenant_servers.configs(admin.id, ["mine"]).values()
    assert isinstance(config, ServerConfig)
    assert config.headers == {"Authorization": f"Bearer {TOKEN}", "X-Team": "blue"}
    assert secrets == ("MCP_TOKEN",)
