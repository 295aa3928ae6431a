"""``output_schema``: the provider is asked in its structured-output mode, the final answer is
validated, an invalid one goes back to the model (a committed step each) until the limit, and
``result.output`` is the parsed JSON. Against the OpenAI- and Anthropic-compatible test
servers on real HTTP, and the scripted model."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from shared.failpoints import InjectedFault
from tests.conftest import Configure, TenantHandle
from tests.fakes.anthropic_server import MessagesServer, message
from tests.fakes.openai_server import (
    OpenAIServer,
    answer,
    tool_call,
)
from tests.helpers import scripted_task

SCHEMA = {
    "type": "object",
    "properties": {"total": {"type": "number"}, "currency": {"type": "string"}},
    "required": ["total", "currency"],
    "additionalProperties": False,
}


def _submit(client: TestClient, tenant: TenantHandle, **body: Any) -> str:
    response = client.post(
        "/v1/tasks", json={"input": "Read the receipt."} | body, headers=tenant.headers
    )
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _task(client: TestClient, tenant: TenantHandle, task_id: str) -> dict[str, Any]:
    return dict(client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json())


def _steps(client: TestClient, tenant: TenantHandle, task_id: str) -> list[dict[str, Any]]:
    return list(client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()["items"])


def test_an_invalid_first_answer_is_corrected_on_the_second(
    openai_provider: OpenAIServer,
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
) -> None:
    openai_provider.reply(
        answer('{"total": "12.50"}'), answer('{"total": 12.5, "currency": "EUR"}')
    )
    task_id = _submit(client, tenant, model="openai:gpt-4o-mini", output_schema=SCHEMA)

    assert drive(task_id) == "succeeded"

    task = _task(client, tenant, task_id)
    assert task["result"] == {"output": {"total": 12.5, "currency": "EUR"}}
    assert task["steps"] == 2
    first, second = openai_provider.requests
    for sent in (first, second):
        assert sent.body["response_format"] == {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": SCHEMA, "strict": True},
        }
    *_, said, feedback = second.messages
    assert said == {"role": "assistant", "content": '{"total": "12.50"}'}
    assert feedback["role"] == "user"
    assert "the answer.total: '12.50' is not of type 'number'" in feedback["content"]
    steps = _steps(client, tenant, task_id)
    assert [s["status"] for s in steps] == ["completed", "completed"]
    assert "is not of type 'number'" in steps[0]["model"]["output_error"]
    assert "output_error" not in steps[1]["model"]


def test_an_answer_that_never_validates_fails_the_task_after_the_limit(
    openai_provider: OpenAIServer,
    configure: Configure,
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
) -> None:
    configure(RATCHET_OUTPUT_RETRIES="2")
    openai_provider.reply(answer("twelve euros"), answer("[]"), answer('{"total": 12.5}'))
    task_id = _submit(client, tenant, model="openai:gpt-4o-mini", output_schema=SCHEMA)

    assert drive(task_id) == "failed"

    task = _task(client, tenant, task_id)
    assert task["error"]["type"] == "invalid_output"
    assert "after 2 retries" in task["error"]["message"]
    assert "'currency' is a required property" in task["error"]["message"]
    assert task["result"] is None
    assert len(openai_provider.requests) == 3  # the first try and two retries, no more
    feedback = [m for m in openai_provider.requests[2].messages if m["role"] == "user"][1:]
    assert ["the answer is not JSON" in m["content"] for m in feedback] == [True, False]


def test_a_schema_strict_mode_cannot_take_is_sent_as_not_strict(
    openai_provider: OpenAIServer,
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
) -> None:
    schema = {"title": "A list of words!", "type": "array", "items": {"type": "string"}}
    openai_provider.reply(answer('["a", "b"]'))
    task_id = _submit(client, tenant, model="openai:gpt-4o-mini", output_schema=schema)

    assert drive(task_id) == "succeeded"

    assert _task(client, tenant, task_id)["result"] == {"output": ["a", "b"]}
    (sent,) = openai_provider.requests
    assert sent.body["response_format"]["json_schema"] == {
        "name": "A_list_of_words_",
        "schema": schema,
        "strict": False,
    }


def test_the_agent_may_use_its_tools_before_its_structured_answer(
    openai_provider: OpenAIServer,
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
) -> None:
    openai_provider.reply(
        tool_call("calculator", {"expression": "10+2.5"}),
        answer('{"total": 12.5, "currency": "EUR"}'),
    )
    task_id = _submit(
        client, tenant, model="openai:gpt-4o-mini", tools=["calculator"], output_schema=SCHEMA
    )

    assert drive(task_id) == "succeeded"
    assert _task(client, tenant, task_id)["result"] == {
        "output": {"total": 12.5, "currency": "EUR"}
    }
    assert all(
        "response_format" in sent.body and sent.body["tools"] for sent in openai_provider.requests
    )


def test_a_task_without_a_schema_keeps_its_text_output_and_own_response_format(
    openai_provider: OpenAIServer,
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
) -> None:
    openai_provider.reply(answer('{"total": 1}'))
    options = {"response_format": {"type": "json_object"}}
    task_id = _submit(client, tenant, model="openai:gpt-4o-mini", model_options=options)

    assert drive(task_id) == "succeeded"
    assert _task(client, tenant, task_id)["result"] == {"output": '{"total": 1}'}
    assert openai_provider.requests[0].body["response_format"] == {"type": "json_object"}


def _tool_use(name: str, arguments: dict[str, Any], call_id: str = "toolu_1") -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def test_anthropic_answers_through_the_forced_output_tool(
    anthropic_provider: Callable[..., MessagesServer],
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
) -> None:
    server = anthropic_provider(
        message(
            [_tool_use("final_answer", {"total": 3, "currency": "USD"})], "tool_use", tokens=(30, 9)
        )
    )
    task_id = _submit(client, tenant, model="anthropic:claude-test", tools=[], output_schema=SCHEMA)

    assert drive(task_id) == "succeeded"

    assert _task(client, tenant, task_id)["result"] == {"output": {"total": 3, "currency": "USD"}}
    (sent,) = (r["body"] for r in server.requests)
    [tool] = sent["tools"]
    assert (tool["name"], tool["input_schema"]) == ("final_answer", SCHEMA)
    assert sent["tool_choice"] == {"type": "tool", "name": "final_answer"}


def test_anthropic_calls_its_tools_first_then_the_output_tool(
    anthropic_provider: Callable[..., MessagesServer],
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
) -> None:
    server = anthropic_provider(
        message([_tool_use("calculator", {"expression": "2*3"})], "tool_use", tokens=(30, 9)),
        message([_tool_use("final_answer", {"total": 6}, "toolu_2")], "tool_use", tokens=(40, 9)),
        message(
            [_tool_use("final_answer", {"total": 6, "currency": "USD"}, "toolu_3")],
            "tool_use",
            tokens=(50, 9),
        ),
    )
    task_id = _submit(
        client, tenant, model="anthropic:claude-test", tools=["calculator"], output_schema=SCHEMA
    )

    assert drive(task_id) == "succeeded"

    assert _task(client, tenant, task_id)["result"] == {"output": {"total": 6, "currency": "USD"}}
    first, second, third = (r["body"] for r in server.requests)
    assert [t["name"] for t in first["tools"]] == ["calculator", "final_answer"]
    assert first["tool_choice"] == {"type": "any"}
    # The invalid answer went back as the assistant's text, the error as the user's reply.
    said, feedback = third["messages"][-2:]
    assert said["role"] == "assistant"
    assert json.loads(said["content"][0]["text"]) == {"total": 6}
    assert feedback["role"] == "user"
    assert "'currency' is a required property" in str(feedback["content"])
    assert [s["model"]["tool_calls"] for s in _steps(client, tenant, task_id)][1:] == [[], []]
    assert second["messages"][-1]["content"][0]["type"] == "tool_result"


def test_anthropic_wraps_a_schema_whose_root_is_not_an_object(
    anthropic_provider: Callable[..., MessagesServer],
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
) -> None:
    schema = {
        "type": "array",
        "items": {"$ref": "#/$defs/word"},
        "$defs": {"word": {"type": "string"}},
    }
    server = anthropic_provider(
        message([_tool_use("final_answer", {"output": ["a"]})], "tool_use", tokens=(9, 9))
    )
    task_id = _submit(client, tenant, model="anthropic:claude-test", tools=[], output_schema=schema)

    assert drive(task_id) == "succeeded"

    assert _task(client, tenant, task_id)["result"] == {"output": ["a"]}
    (sent,) = (r["body"] for r in server.requests)
    assert sent["tools"][0]["input_schema"] == {
        "type": "object",
        "properties": {"output": {"type": "array", "items": {"$ref": "#/$defs/word"}}},
        "required": ["output"],
        "$defs": {"word": {"type": "string"}},
    }


def test_a_crash_after_an_invalid_answer_resumes_without_asking_or_judging_again(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    failpoint: Callable[[str], None],
) -> None:
    from workers.steps import runner

    script = [{"content": "not JSON"}, {"content": '{"total": 1, "currency": "EUR"}'}]
    task_id = _submit(client, tenant, **scripted_task(script), output_schema=SCHEMA)
    failpoint("after_model_commit=raise")
    with pytest.raises(InjectedFault):
        runner.advance(task_id, 1)
    failpoint("")
    _expire_lease(task_id)

    assert drive(task_id) == "succeeded"

    steps = _steps(client, tenant, task_id)
    assert [s["number"] for s in steps] == [1, 2]
    assert steps[0]["model"]["output_error"].startswith("the answer is not JSON")
    assert _task(client, tenant, task_id)["result"] == {"output": {"total": 1, "currency": "EUR"}}


def _expire_lease(task_id: str) -> None:
    from sqlalchemy import update

    from shared.store.db import transaction
    from shared.store.tables import Task

    with transaction() as session:
        session.execute(update(Task).where(Task.id == task_id).values(lease_expires_ms=0))


def test_an_agents_schema_applies_unless_the_task_gives_its_own(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    from shared.agents.registry import Agent, get_registry, register_agent

    register_agent(Agent(name="receipts", output_schema={"type": "integer"}))
    try:
        agents = client.get("/v1/agents", headers=tenant.headers).json()["items"]
        assert next(a for a in agents if a["name"] == "receipts")["output_schema"] == {
            "type": "integer"
        }
        by_agent = _submit(client, tenant, agent="receipts", **scripted_task([{"content": "7"}]))
        own = _submit(
            client,
            tenant,
            agent="receipts",
            output_schema={"type": "string"},
            **scripted_task([{"content": '"seven"'}]),
        )
        assert drive(by_agent) == drive(own) == "succeeded"
        assert _task(client, tenant, by_agent)["result"] == {"output": 7}
        assert _task(client, tenant, own)["result"] == {"output": "seven"}
    finally:
        get_registry().agents.pop("receipts", None)


def test_an_agent_with_an_invalid_schema_is_refused_at_registration() -> None:
    from shared.agents.registry import Agent, register_agent

    with pytest.raises(ValueError, match=r"agent 'broken': output_schema\.type"):
        register_agent(Agent(name="broken", output_schema={"type": "nope"}))


@pytest.mark.parametrize(
    ("schema", "field", "detail"),
    [
        ([1, 2], "output_schema", "Input should be an object"),
        ({"type": "nope"}, "output_schema.type", "is not valid under any of the given schemas"),
        (
            {"properties": {"a": {"minimum": "x"}}},
            "output_schema.properties.a.minimum",
            "not of type 'number'",
        ),
        ({"$ref": "https://example.com/s.json"}, "output_schema.$ref", "only references inside"),
        ({"items": {"$ref": "#/$defs/gone"}}, "output_schema.items.$ref", "points at nothing"),
        (
            {"$schema": "https://example.com/draft"},
            "output_schema.$schema",
            "unknown JSON Schema draft",
        ),
        ({"description": "x" * 70_000}, "output_schema", "RATCHET_OUTPUT_SCHEMA_MAX_BYTES"),
    ],
)
def test_a_bad_schema_is_a_422_that_changes_nothing(
    client: TestClient, tenant: TenantHandle, schema: Any, field: str, detail: str
) -> None:
    before = _task_count(tenant)
    response = client.post(
        "/v1/tasks",
        json=scripted_task([{"content": "1"}], output_schema=schema),
        headers=tenant.headers,
    )

    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    [error] = response.json()["errors"]
    assert error["field"] == field
    assert detail in error["detail"]
    assert _task_count(tenant) == before


def _task_count(tenant: TenantHandle) -> int:
    from shared.store.db import transaction
    from shared.store.tables import Task

    with transaction() as session:
        return int(
            session.scalar(
                select(func.count()).select_from(Task).where(Task.tenant_id == tenant.id)
            )
            or 0
        )


def test_the_openapi_document_says_what_output_holds(client: TestClient) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert "output_schema" in schemas["TaskCreate"]["properties"]
    result = schemas["TaskView"]["properties"]["result"]
    output = result["anyOf"][0]["properties"]["output"]
    assert "the JSON value" in output["description"]


def test_the_task_page_shows_a_structured_output_as_json_and_what_was_sent_back(
    client: TestClient, make_tenant: Callable[..., TenantHandle], drive: Callable[..., str]
) -> None:
    admin = make_tenant(("admin", "tasks:read", "tasks:write"))
    script = [{"content": '{"total": 2}'}, {"content": '{"total": 2, "currency": "EUR"}'}]
    task_id = _submit(client, admin, **scripted_task(script), output_schema=SCHEMA)
    assert drive(task_id) == "succeeded"

    answer = client.post("/dashboard/login", data={"key": admin.key}, follow_redirects=False)
    assert answer.status_code == 303, answer.text
    page = client.get(f"/dashboard/tasks/{task_id}").text
    assert '<pre>{\n  "currency": "EUR",\n  "total": 2\n}</pre>' in page
    assert "sent back: the answer misses the output schema" in page
    assert "the answer: &#39;currency&#39; is a required property" in page


def test_the_openapi_document_says_a_step_may_carry_its_output_error(client: TestClient) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert "output_error" in schemas["StepOut"]["properties"]["model"]["description"]
