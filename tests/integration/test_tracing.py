"""OpenTelemetry spans of real steps: one trace per task, its root span emitted by the step that
ends it, a child span per step, and GenAI spans for model and tool calls."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from shared.observability import tracing
from tests.conftest import TenantHandle
from tests.helpers import calculator_script, scripted_task

_exporter = InMemorySpanExporter()


@pytest.fixture(scope="session")
def installed() -> InMemorySpanExporter:
    tracing.install(SimpleSpanProcessor(_exporter), service="ratchet-test")  # once a process
    return _exporter


@pytest.fixture
def spans(installed: InMemorySpanExporter) -> Iterator[Callable[[str], list[ReadableSpan]]]:
    installed.clear()

    def of_task(task_id: str) -> list[ReadableSpan]:
        trace_id, _ = tracing.task_ids(task_id)
        found = installed.get_finished_spans()
        return [s for s in found if s.context is not None and s.context.trace_id == trace_id]

    yield of_task
    installed.clear()


def submit(client: TestClient, tenant: TenantHandle, body: dict[str, Any]) -> str:
    response = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def named(spans: list[ReadableSpan], prefix: str) -> list[ReadableSpan]:
    return sorted((s for s in spans if s.name.startswith(prefix)), key=lambda s: s.start_time or 0)


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_a_task_is_one_trace_with_a_span_per_step_and_per_call(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    spans: Callable[[str], list[ReadableSpan]],
) -> None:
    task_id = submit(client, tenant, scripted_task(calculator_script(3)))
    assert drive(task_id) == "succeeded"
    found = spans(task_id)
    _, root_id = tracing.task_ids(task_id)

    [task] = named(found, "ratchet.task")
    assert task.context is not None
    assert (task.context.span_id, task.parent) == (root_id, None)
    assert task.attributes is not None
    assert task.attributes["ratchet.status"] == "succeeded"
    assert task.attributes["ratchet.steps"] == 3
    assert task.status.status_code != StatusCode.ERROR
    created = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json()["created_at"]
    assert task.start_time is not None
    assert task.end_time is not None
    assert task.start_time < task.end_time
    # the root span starts at the task's creation, before any step ran
    created_s = datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
    assert abs(task.start_time / 1e9 - created_s) < 0.01

    steps = named(found, "ratchet.step")
    assert [s.name for s in steps] == ["ratchet.step 1", "ratchet.step 2", "ratchet.step 3"]
    assert all(parent_id(s) == root_id for s in steps)
    assert [s.attributes["ratchet.outcome"] for s in steps if s.attributes] == [
        "committed",
        "committed",
        "finished",
    ]
    assert all(task.start_time <= (s.start_time or 0) for s in steps)

    chats = named(found, "chat ")
    assert len(chats) == 3
    step_ids = [s.context.span_id for s in steps if s.context is not None]
    assert [parent_id(c) for c in chats] == step_ids
    for chat in chats:
        assert chat.attributes is not None
        assert chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.provider.name"] == "scripted"
        assert int(str(chat.attributes["gen_ai.usage.output_tokens"])) >= 1

    tools = named(found, "execute_tool calculator")
    assert [parent_id(t) for t in tools] == step_ids[:2]
    assert all(t.attributes and t.attributes["gen_ai.tool.name"] == "calculator" for t in tools)


def test_calls_that_run_at_once_are_each_a_span_of_their_step(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    spans: Callable[[str], list[ReadableSpan]],
) -> None:
    calls = [{"name": "calculator", "arguments": {"expression": f"{n}*7"}} for n in range(3)]
    task_id = submit(client, tenant, scripted_task([{"tool_calls": calls}, {"content": "ok"}]))
    assert drive(task_id) == "succeeded"
    found = spans(task_id)

    [first, _] = named(found, "ratchet.step")
    assert first.context is not None
    tools = named(found, "execute_tool calculator")
    # Each ran on a thread of its own, in the step's context: its span is the step's child.
    assert [parent_id(t) for t in tools] == [first.context.span_id] * 3
    assert len({t.context.span_id for t in tools if t.context is not None}) == 3


def test_a_failed_task_ends_its_trace_with_an_error(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    spans: Callable[[str], list[ReadableSpan]],
) -> None:
    body = scripted_task(
        [{"content": "big", "usage": {"input_tokens": 900, "output_tokens": 200}}],
        budget={"max_tokens": 1000},
    )
    task_id = submit(client, tenant, body)
    assert drive(task_id) == "failed"
    [task] = named(spans(task_id), "ratchet.task")
    assert task.attributes is not None
    assert task.attributes["ratchet.status"] == "failed"
    assert task.status.status_code == StatusCode.ERROR
    assert task.attributes["gen_ai.usage.input_tokens"] == 900
