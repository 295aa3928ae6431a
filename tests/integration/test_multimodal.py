"""Multimodal input: a user message's text, image and file parts are checked at submission,
stored once in the task's input, and reach each provider in its own wire format (real HTTP
to the OpenAI- and Anthropic-compatible test servers)."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from tests.conftest import Configure, TenantHandle
from tests.fakes.anthropic_server import MessagesServer, message
from tests.fakes.openai_server import (
    OpenAIServer,
    answer,
    tool_call,
)
from tests.helpers import scripted_task

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(range(64))).decode()
JPEG = base64.b64encode(b"\xff\xd8\xff\xe0" + bytes(32)).decode()
PDF = base64.b64encode(b"%PDF-1.7\n" + b"0" * 64).decode()
NOTES = base64.b64encode(b"Total: 12.50 EUR").decode()
URL = "https://example.com/receipt.png"
PARTS: list[dict[str, Any]] = [
    {"type": "text", "text": "What is the total?"},
    {"type": "image", "url": URL},
    {"type": "image", "data": PNG, "media_type": "image/png"},
    {"type": "file", "data": PDF, "media_type": "application/pdf", "name": "receipt.pdf"},
    {"type": "file", "data": NOTES, "media_type": "text/plain", "name": "notes.txt"},
]
INPUT = [
    {"role": "system", "content": "You read receipts."},
    {"role": "user", "content": PARTS},
]


def _submit(client: TestClient, tenant: TenantHandle, **body: Any) -> str:
    response = client.post("/v1/tasks", json={"input": INPUT} | body, headers=tenant.headers)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def test_parts_reach_an_openai_compatible_server_in_its_format(
    openai_provider: OpenAIServer,
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
) -> None:
    openai_provider.reply(tool_call("calculator", {"expression": "10+2.5"}), answer("12.50 EUR"))
    task_id = _submit(client, tenant, model="openai:gpt-4o-mini", tools=["calculator"])

    assert drive(task_id) == "succeeded"

    expected = [
        {"type": "text", "text": "What is the total?"},
        {"type": "image_url", "image_url": {"url": URL}},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        {
            "type": "file",
            "file": {"file_data": f"data:application/pdf;base64,{PDF}", "filename": "receipt.pdf"},
        },
        {"type": "text", "text": "notes.txt:\nTotal: 12.50 EUR"},
    ]
    for sent in openai_provider.requests:  # the parts come back on every step, from the one copy
        assert {"role": "system", "content": "You read receipts."} in sent.messages
        assert {"role": "user", "content": expected} in sent.messages


def test_parts_reach_an_anthropic_server_in_its_format(
    anthropic_provider: Callable[..., MessagesServer],
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
) -> None:
    server = anthropic_provider(
        message([{"type": "text", "text": "12.50 EUR"}], "end_turn", tokens=(9, 3))
    )
    task_id = _submit(client, tenant, model="anthropic:claude-test", tools=[])

    assert drive(task_id) == "succeeded"

    (sent,) = (r["body"] for r in server.requests)
    assert "You read receipts." in str(sent["system"])
    [user] = sent["messages"]
    blocks = [{k: v for k, v in b.items() if k != "cache_control"} for b in user["content"]]
    assert blocks == [
        {"type": "text", "text": "What is the total?"},
        {"type": "image", "source": {"type": "url", "url": URL}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": PDF},
            "title": "receipt.pdf",
        },
        {
            "type": "document",
            "source": {"type": "text", "media_type": "text/plain", "data": "Total: 12.50 EUR"},
            "title": "notes.txt",
        },
    ]


def test_parts_are_stored_once_and_the_scripted_model_runs_with_them(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    from shared.store.db import transaction
    from shared.store.tables import Step, Task

    script = [
        {"tool_calls": [{"name": "calculator", "arguments": {"expression": "1+1"}}]},
        {"content": "read"},
    ]
    task_id = _submit(client, tenant, **scripted_task(script) | {"input": INPUT})

    assert drive(task_id) == "succeeded"

    with transaction() as session:
        task = session.get(Task, task_id)
        assert task is not None
        assert task.input == INPUT
        steps = session.scalars(select(Step).where(Step.task_id == task_id)).all()
        assert len(steps) == 2
        assert all(PNG not in str(step.response) for step in steps)
        assert all(0 < step.input_tokens < 20_000 for step in steps)  # an estimate, not base64's


def _user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


@pytest.mark.parametrize(
    ("input", "field", "detail"),
    [
        (
            _user({"type": "video", "url": URL}),
            "input[0].content[0]",
            "does not match any of the expected tags",
        ),
        (
            _user({"type": "image", "data": "not base64!", "media_type": "image/png"}),
            "input[0].content[0].data",
            "match pattern",
        ),
        (
            _user({"type": "image", "data": "iVBORw0KGgo", "media_type": "image/png"}),
            "input[0].content[0]",
            "not valid base64",
        ),
        (
            _user({"type": "image", "data": JPEG, "media_type": "image/png"}),
            "input[0].content[0]",
            "data is not image/png",
        ),
        (
            _user({"type": "image", "data": PNG, "media_type": "image/tiff"}),
            "input[0].content[0].media_type",
            "Input should be",
        ),
        (_user({"type": "image", "data": PNG}), "input[0].content[0]", "data needs its media_type"),
        (
            _user({"type": "image", "url": URL, "data": PNG, "media_type": "image/png"}),
            "input[0].content[0]",
            "not both",
        ),
        (
            _user({"type": "image", "url": "http://169.254.169.254/latest"}),
            "input[0].content[0]",
            "private, loopback or link-local",
        ),
        (
            _user({"type": "image", "url": "http://localhost/cat.png"}),
            "input[0].content[0]",
            "local address",
        ),
        (
            _user({"type": "image", "url": "file:///etc/passwd"}),
            "input[0].content[0]",
            "http or https",
        ),
        (
            _user({"type": "file", "data": PNG, "media_type": "application/pdf"}),
            "input[0].content[0]",
            "data is not application/pdf",
        ),
        (
            _user(
                {
                    "type": "file",
                    "data": base64.b64encode(b"\xff\xfe").decode(),
                    "media_type": "text/plain",
                }
            ),
            "input[0].content[0]",
            "UTF-8",
        ),
        (
            [{"role": "assistant", "content": [{"type": "text", "text": "hi"}]}],
            "input[0]",
            "only a user message",
        ),
        (_user(), "input[0].content", "at least 1 item"),
    ],
)
def test_a_bad_part_is_a_422_that_changes_nothing(
    client: TestClient, tenant: TenantHandle, input: Any, field: str, detail: str
) -> None:
    before = _task_count(tenant)
    response = client.post(
        "/v1/tasks", json=scripted_task([{"content": "ok"}], input=input), headers=tenant.headers
    )

    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    errors = response.json()["errors"]
    assert any(e["field"] == field and detail in e["detail"] for e in errors), errors
    assert _task_count(tenant) == before


@pytest.mark.parametrize(
    ("setting", "parts", "field"),
    [
        ("RATCHET_INPUT_PART_MAX_BYTES", 1, "input[0].content[1].data"),  # 1,109 bytes > 1,024
        ("RATCHET_INPUT_MAX_BYTES", 2, "input"),  # 2 × 1,109 bytes > 2,000
    ],
)
def test_parts_over_the_size_limits_are_a_422_that_changes_nothing(
    configure: Configure,
    client: TestClient,
    tenant: TenantHandle,
    setting: str,
    parts: int,
    field: str,
) -> None:
    configure(**{setting: "1024" if parts == 1 else "2000"})
    big = base64.b64encode(b"%PDF-1.7\n" + b"0" * 1100).decode()
    pdf = {"type": "file", "data": big, "media_type": "application/pdf"}
    before = _task_count(tenant)
    response = client.post(
        "/v1/tasks",
        json=scripted_task(
            [{"content": "ok"}], input=_user({"type": "text", "text": "read"}, *[pdf] * parts)
        ),
        headers=tenant.headers,
    )

    assert response.status_code == 422, response.text
    [error] = response.json()["errors"]
    assert error["field"] == field
    assert setting in error["detail"]
    assert _task_count(tenant) == before


def _task_count(tenant: TenantHandle) -> int:
    from shared.store.db import transaction
    from shared.store.tables import Task

    with transaction() as session:
        query = select(func.count()).select_from(Task).where(Task.tenant_id == tenant.id)
        return int(session.scalar(query) or 0)


def test_the_task_page_shows_a_parts_size_not_its_base64(
    client: TestClient, make_tenant: Callable[..., TenantHandle], drive: Callable[..., str]
) -> None:
    admin = make_tenant(("admin", "tasks:read", "tasks:write"))
    task_id = _submit(client, admin, **scripted_task([{"content": "read"}]) | {"input": INPUT})
    assert drive(task_id) == "succeeded"

    login = client.post("/dashboard/login", data={"key": admin.key}, follow_redirects=False)
    assert login.status_code == 303, login.text
    page = client.get(f"/dashboard/tasks/{task_id}").text
    assert PNG not in page
    assert PDF not in page
    assert f"({len(base64.b64decode(PNG)):,} bytes of base64)" in page
    assert URL in page
