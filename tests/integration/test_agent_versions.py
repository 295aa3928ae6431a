"""Pinned agent versions: a task runs the agent definition it was submitted with, whatever the
registry says when its steps run; one definition is one version row; the versions are listed
per agent."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from tests.conftest import TenantHandle
from tests.fakes.openai_server import OpenAIServer, answer, tool_call

MODEL = "openai:gpt-4o-mini"


@pytest.fixture
def registry() -> Iterator[Callable[..., str]]:
    """Defines the test's agent (``define(prompt, tools)``, which returns its name, one of
    the test's own), as a deploy would: its tools ``lookup`` and ``archive`` registered anew
    each time, and only those named. The registry is put back as it was when the test ends."""
    from shared.agents.registry import Agent, get_registry, register_agent, tool

    live = get_registry()
    tools, agents = dict(live.tools), dict(live.agents)
    agent = f"versioned-{uuid.uuid4().hex[:8]}"

    def define(
        prompt: str,
        names: tuple[str, ...] = ("lookup", "archive"),
        doc: str = "",
        limit: int | None = None,
    ) -> str:
        for name in ("lookup", "archive"):
            live.tools.pop(name, None)

        def lookup(key: str) -> str:
            return f"value of {key}"

        def archive(key: str, reason: str) -> str:
            return f"archived {key}"

        lookup.__doc__ = doc or "Look a key up."
        archive.__doc__ = "Archive a record."
        for name, func_ in (("lookup", lookup), ("archive", archive)):
            if name in names:
                tool(idempotent=name == "lookup", timeout=5, max_result_chars=limit)(func_)
        register_agent(Agent(name=agent, system_prompt=prompt, tools=names))
        return agent

    yield define
    live.tools.clear()
    live.tools.update(tools)
    live.agents.clear()
    live.agents.update(agents)


def _submit(client: TestClient, tenant: TenantHandle, agent: str, **body: Any) -> dict[str, Any]:
    response = client.post(
        "/v1/tasks",
        json={"agent": agent, "input": "Archive record 7.", "model": MODEL} | body,
        headers=tenant.headers,
    )
    assert response.status_code == 202, response.text
    return dict(response.json())


def _version_rows(agent: str) -> dict[str, dict[str, Any]]:
    from shared.store.db import transaction
    from shared.store.tables import AgentVersion

    with transaction() as session:
        rows = session.scalars(select(AgentVersion).where(AgentVersion.agent == agent)).all()
        return {row.id: row.definition for row in rows}


def test_a_step_runs_the_version_it_was_submitted_with(
    openai_provider: OpenAIServer,
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    registry: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Submitted, then a deploy: a new system prompt, ``archive`` removed, ``lookup``
    described anew. Every model call of the task still carries the original prompt and tool
    schemas, and its call of ``archive`` is a tool error the model reads."""
    from shared.agents import versions
    from shared.agents.registry import get_registry

    agent = registry("You keep the archive.")
    before = {name: get_registry().tools[name] for name in ("lookup", "archive")}
    sent_tools = [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.parameters_schema,
            },
        }
        for tool in before.values()
    ]
    task = _submit(client, tenant, agent)
    assert task["agent_version"] in _version_rows(agent)

    registry("You are a new prompt.", ("lookup",), doc="Look a key up, newly described.")
    # As a worker that never computed the old version: it reads the version's row.
    monkeypatch.setattr(versions, "_read", {})
    openai_provider.reply(
        tool_call("archive", {"key": "7", "reason": "old"}, call_id="call_1"),
        answer("I could not archive it."),
    )
    assert drive(task["id"]) == "succeeded"

    first, second = openai_provider.requests
    for sent in (first, second):
        assert sent.messages[0] == {"role": "system", "content": "You keep the archive."}
        assert sent.body["tools"] == sent_tools
    refused = second.messages[-1]
    assert refused["role"] == "tool"
    assert refused["tool_call_id"] == "call_1"
    assert refused["content"] == (
        "error: tool 'archive' is not available in this deployment (removed after the task "
        "started); the call was not run"
    )

    steps = client.get(f"/v1/tasks/{task['id']}/steps", headers=tenant.headers).json()["items"]
    [call] = steps[0]["tool_calls"]
    assert call["name"] == "archive"
    assert call["status"] == "failed"
    assert "not available in this deployment (removed after the task started)" in call["error"]
    read = client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()
    assert read["agent_version"] == task["agent_version"]


def test_a_tool_still_deployed_runs_with_the_pinned_behaviour(
    openai_provider: OpenAIServer,
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    registry: Callable[..., str],
) -> None:
    """The tool's code is the deployment's, and runs: a tool the deploy kept answers, and the
    model reads as much of its result as the pinned version says (here: 200 characters)."""
    agent = registry("You keep the archive.", limit=200)
    task = _submit(client, tenant, agent, tools=["lookup"])
    registry("You are a new prompt.", ("lookup",), doc="Look a key up, newly described.")
    key = "k" * 1000
    openai_provider.reply(
        tool_call("lookup", {"key": key}, call_id="c1"),
        tool_call("lookup", {"key": "short"}, call_id="c2"),
        answer("done"),
    )
    assert drive(task["id"]) == "succeeded"
    first, second, third = openai_provider.requests
    assert first.body["tools"][0]["function"]["description"] == "Look a key up."
    for sent in (second, third):  # every later request holds it as cut
        cut = next(m for m in sent.messages if m.get("tool_call_id") == "c1")["content"]
        assert cut.startswith("value of kkk")
        assert "characters cut out here" in cut
        assert len(cut) < 400
    assert third.messages[-1]["content"] == "value of short"


def test_a_task_from_before_pinning_runs_the_live_agent(
    openai_provider: OpenAIServer,
    tenant: TenantHandle,
    drive: Callable[..., str],
    registry: Callable[..., str],
) -> None:
    """A task with no version (from before versions were pinned) reads the registry."""
    from shared.store.db import transaction
    from shared.store.tasks import NewTask, create_task

    agent = registry("The old prompt.")
    spec = NewTask(
        agent=agent,
        model=MODEL,
        input="hi",
        instructions=None,
        tools=["lookup"],
        model_options={},
        max_steps=5,
        budget=None,
        webhook=None,
        metadata={},
    )
    with transaction() as session:
        task_id = create_task(session, tenant.id, spec).task.id
    registry("The live prompt.")
    openai_provider.reply(answer("hello"))
    assert drive(task_id) == "succeeded"
    [sent] = openai_provider.requests
    assert sent.messages[0] == {"role": "system", "content": "The live prompt."}


@pytest.mark.backends("postgresql", "sqlite")
def test_one_definition_is_one_version(
    client: TestClient, tenant: TenantHandle, registry: Callable[..., str]
) -> None:
    agent = registry("Prompt one.")
    first = _submit(client, tenant, agent, model="scripted")
    again = _submit(client, tenant, agent, model="scripted", tools=["lookup"])
    assert first["agent_version"] == again["agent_version"]
    rows = _version_rows(agent)
    assert list(rows) == [first["agent_version"]]
    definition = rows[first["agent_version"]]
    assert definition["system_prompt"] == "Prompt one."
    assert [t["name"] for t in definition["tools"]] == ["lookup", "archive"]
    assert definition["tools"][0]["idempotent"] is True
    assert definition["tools"][0]["parameters"]["required"] == ["key"]

    registry("Prompt one.")  # the same definition, registered again: the same version
    assert (
        _submit(client, tenant, agent, model="scripted")["agent_version"] == first["agent_version"]
    )
    registry("Prompt two.")
    second = _submit(client, tenant, agent, model="scripted")
    assert second["agent_version"] != first["agent_version"]
    assert set(_version_rows(agent)) == {first["agent_version"], second["agent_version"]}


@pytest.mark.backends("postgresql", "sqlite")
def test_a_version_written_in_a_rolled_back_transaction_is_written_again(
    backend_env: dict[str, str], registry: Callable[..., str]
) -> None:
    """The process remembers a version as written only once its transaction commits."""
    from shared.agents import versions
    from shared.store.db import get_sessionmaker, transaction

    agent = registry("Prompt rolled back.")

    with get_sessionmaker()() as session:
        session.begin()
        version = versions.current_version(session, agent)
        session.rollback()
    assert _version_rows(agent) == {}
    with transaction() as session:
        assert versions.current_version(session, agent) == version
    assert list(_version_rows(agent)) == [version]


@pytest.mark.backends("postgresql", "sqlite")
def test_the_versions_of_an_agent_newest_first(
    client: TestClient, tenant: TenantHandle, registry: Callable[..., str]
) -> None:
    made = []
    for n in range(3):
        agent = registry(f"Prompt {n}.")
        made.append(_submit(client, tenant, agent, model="scripted")["agent_version"])

    url = f"/v1/agents/{agent}/versions"
    listed, cursor = [], None
    while True:
        page = client.get(
            url,
            params={"limit": 2} | ({"cursor": cursor} if cursor else {}),
            headers=tenant.headers,
        )
        assert page.status_code == 200, page.text
        body = page.json()
        assert len(body["items"]) <= 2
        listed += body["items"]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert [v["id"] for v in listed] == made[::-1]
    assert all(v["agent"] == agent for v in listed)

    one = client.get(f"{url}/{made[0]}", headers=tenant.headers)
    assert one.status_code == 200
    assert one.json()["definition"]["system_prompt"] == "Prompt 0."
    assert one.json()["created_at"] == listed[-1]["created_at"]

    for missing in (
        "/v1/agents/no-such-agent/versions",
        f"{url}/{'0' * 64}",
        f"/v1/agents/default/versions/{made[0]}",  # another agent's version
    ):
        response = client.get(missing, headers=tenant.headers)
        assert response.status_code == 404, missing
        assert response.headers["content-type"] == "application/problem+json"
    bad = client.get(url, params={"cursor": "bm90IGEgY3Vyc29y"}, headers=tenant.headers)
    assert bad.status_code == 422
    assert [e["field"] for e in bad.json()["errors"]] == ["cursor"]


@pytest.mark.backends("postgresql", "sqlite")
def test_the_task_page_shows_the_version(
    client: TestClient,
    make_tenant: Callable[..., TenantHandle],
    registry: Callable[..., str],
) -> None:
    from shared.store.tenants import ADMIN, TENANT_SCOPES
    from tests.integration.test_dashboard import login

    admin = make_tenant((*TENANT_SCOPES, ADMIN))
    task = _submit(client, admin, registry("Prompt."), model="scripted")
    login(client, admin.key)
    page = client.get(f"/dashboard/tasks/{task['id']}")
    assert page.status_code == 200
    assert f">{task['agent_version'][:12]}</code>" in page.text


def test_a_schedule_tick_runs_the_agent_as_it_is_when_the_tick_fires(
    client: TestClient, tenant: TenantHandle, registry: Callable[..., str]
) -> None:
    from tests.helpers import admit
    from tests.integration.test_scheduling import move_tick, tasks_of

    agent = registry("Prompt when scheduled.")
    body = {"name": "nightly", "cron": "0 3 * * *", "timezone": "UTC"}
    task = {"agent": agent, "input": "go", "model": "scripted"}
    response = client.post("/v1/schedules", json=body | {"task": task}, headers=tenant.headers)
    assert response.status_code == 201, response.text
    registry("Prompt when fired.")
    move_tick(response.json()["id"], int(time.time() * 1000) - 1000)
    admit()
    (fired,) = tasks_of(response.json()["id"])
    assert _version_rows(agent)[fired.agent_version]["system_prompt"] == "Prompt when fired."
