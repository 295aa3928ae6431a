"""``/v1/threads``: pages, the metadata filter, the conversation, deletion, another tenant's
thread (a 404 on every route) and bad input (a problem, and nothing changed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shared.store.db import transaction
from shared.store.tables import Task, Thread
from tests.conftest import TenantHandle
from tests.helpers import tool_turn

pytestmark = pytest.mark.backends("postgresql", "sqlite")


def new_thread(client: TestClient, tenant: TenantHandle, **metadata: Any) -> str:
    response = client.post(
        "/v1/threads", json={"agent": "ops", "metadata": metadata}, headers=tenant.headers
    )
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def turn(
    client: TestClient, tenant: TenantHandle, thread_id: str, text: str, *, key: str = "k"
) -> dict[str, Any]:
    """A turn of two steps: an upsert_record call, then an answer."""
    script = [tool_turn("upsert_record", key=key), {"content": f"answer to {text}"}]
    response = client.post(
        f"/v1/threads/{thread_id}/runs",
        json={"input": text, "model": "scripted", "model_options": {"script": script}},
        headers=tenant.headers,
    )
    assert response.status_code == 202, response.text
    return dict(response.json())


def test_threads_are_listed_a_page_at_a_time_and_filtered_by_metadata(
    client: TestClient, tenant: TenantHandle
) -> None:
    ids = [new_thread(client, tenant, customer=str(40 + i % 3), tier="gold") for i in range(7)]
    seen: list[str] = []
    cursor = None
    while True:
        query: dict[str, Any] = {"limit": 3} | ({"cursor": cursor} if cursor else {})
        page = client.get("/v1/threads", params=query, headers=tenant.headers).json()
        seen += [item["id"] for item in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids[::-1]  # newest first, each once

    customer_42 = client.get(
        "/v1/threads",
        params={"metadata.customer": "42", "metadata.tier": "gold"},
        headers=tenant.headers,
    ).json()
    assert [t["id"] for t in customer_42["items"]] == [ids[5], ids[2]]
    assert all(t["metadata"]["customer"] == "42" for t in customer_42["items"])
    none = client.get(
        "/v1/threads",
        params={"metadata.customer": "42", "metadata.tier": "silver"},
        headers=tenant.headers,
    ).json()
    assert none == {"items": [], "next_cursor": None}


def test_the_conversation_reads_oldest_first_a_page_at_a_time(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    thread_id = new_thread(client, tenant)
    for k in (1, 2):
        assert drive(turn(client, tenant, thread_id, f"message {k}", key=f"key-{k}")["id"]) == (
            "succeeded"
        )
    whole = client.get(f"/v1/threads/{thread_id}/messages", headers=tenant.headers).json()
    assert whole["next_cursor"] is None
    assert [(m["turn"], m["role"]) for m in whole["items"]] == [
        (k, role) for k in (1, 2) for role in ("user", "assistant", "tool", "assistant")
    ]
    assert [m["content"] for m in whole["items"] if m["role"] != "assistant"] == [
        "message 1",
        "stored key-1",
        "message 2",
        "stored key-2",
    ]
    paged: list[dict[str, Any]] = []
    cursor = None
    while True:
        query: dict[str, Any] = {"limit": 3} | ({"cursor": cursor} if cursor else {})
        page = client.get(
            f"/v1/threads/{thread_id}/messages", params=query, headers=tenant.headers
        ).json()
        paged += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert paged == whole["items"]


def test_a_thread_reads_as_its_latest_turn_leaves_it(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    thread_id = new_thread(client, tenant, customer="42")
    thread = client.get(f"/v1/threads/{thread_id}", headers=tenant.headers).json()
    assert (thread["status"], thread["turns"], thread["latest_turn"]) == ("idle", 0, None)
    assert (thread["agent"], thread["metadata"]) == ("ops", {"customer": "42"})
    first = turn(client, tenant, thread_id, "message 1")
    thread = client.get(f"/v1/threads/{thread_id}", headers=tenant.headers).json()
    assert (thread["status"], thread["latest_turn"]["id"]) == ("busy", first["id"])
    drive(first["id"])
    thread = client.get(f"/v1/threads/{thread_id}", headers=tenant.headers).json()
    assert thread["status"] == "idle"
    assert thread["latest_turn"]["result"] == {"output": "answer to message 1"}


def test_a_thread_is_deleted_with_its_turns_once_none_is_unfinished(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    thread_id = new_thread(client, tenant)
    first = turn(client, tenant, thread_id, "message 1")
    busy = client.delete(f"/v1/threads/{thread_id}", headers=tenant.headers)
    assert busy.status_code == 409
    assert busy.headers["content-type"] == "application/problem+json"
    assert client.get(f"/v1/threads/{thread_id}", headers=tenant.headers).status_code == 200

    drive(first["id"])
    assert client.delete(f"/v1/threads/{thread_id}", headers=tenant.headers).status_code == 204
    assert client.get(f"/v1/threads/{thread_id}", headers=tenant.headers).status_code == 404
    assert client.get(f"/v1/tasks/{first['id']}", headers=tenant.headers).status_code == 404


def test_another_tenants_thread_is_not_found_on_any_route(
    client: TestClient, tenant: TenantHandle, make_tenant: Callable[..., TenantHandle]
) -> None:
    thread_id = new_thread(client, tenant)
    other = make_tenant().headers
    body = {"input": "hello", "model": "scripted"}
    for response in (
        client.get(f"/v1/threads/{thread_id}", headers=other),
        client.get(f"/v1/threads/{thread_id}/messages", headers=other),
        client.get(f"/v1/threads/{thread_id}/events", headers=other),
        client.post(f"/v1/threads/{thread_id}/runs", json=body, headers=other),
        client.delete(f"/v1/threads/{thread_id}", headers=other),
    ):
        assert response.status_code == 404, response.request.url
        assert response.headers["content-type"] == "application/problem+json"
    assert client.get("/v1/threads", headers=other).json()["items"] == []
    with transaction() as session:
        assert session.get(Thread, thread_id) is not None
        assert session.query(Task).filter(Task.thread_id == thread_id).count() == 0


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("post", "/v1/threads", {"agent": "nobody"}, "agent"),
        ("post", "/v1/threads", {"agent": "ops", "colour": "red"}, "colour"),
        ("post", "{thread}/runs", {"input": "hi", "multitask_strategy": "later"}, None),
        ("post", "{thread}/runs", {"input": "hi", "agent": "default"}, "agent"),
        ("post", "{thread}/runs", {"multitask_strategy": "reject"}, None),
        ("get", "/v1/threads?metadata.=1", None, "metadata."),
        ("get", "/v1/threads?cursor=%21%21", None, "cursor"),
        ("get", "{thread}/messages?cursor=bm9wZQ", None, "cursor"),
        ("get", "{thread}/events?after=one", None, "after"),
    ],
)
def test_bad_input_is_a_problem_and_changes_nothing(
    method: str,
    path: str,
    body: dict[str, Any] | None,
    field: str | None,
    client: TestClient,
    tenant: TenantHandle,
) -> None:
    thread_id = new_thread(client, tenant)
    url = path.replace("{thread}", f"/v1/threads/{thread_id}")
    response = client.request(method, url, json=body, headers=tenant.headers)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    if field is not None:
        assert field in {e["field"] for e in response.json()["errors"]}
    with transaction() as session:
        assert session.query(Thread).filter(Thread.tenant_id == tenant.id).count() == 1
        assert session.query(Task).filter(Task.tenant_id == tenant.id).count() == 0
        thread = session.get(Thread, thread_id)
        assert thread is not None
        assert thread.turns == 0


def test_a_turn_answers_again_for_the_same_idempotency_key(
    client: TestClient, tenant: TenantHandle
) -> None:
    thread_id = new_thread(client, tenant)
    body = {"input": "hello", "model": "scripted"}
    headers = tenant.headers | {"Idempotency-Key": "turn-1"}
    first = client.post(f"/v1/threads/{thread_id}/runs", json=body, headers=headers)
    again = client.post(f"/v1/threads/{thread_id}/runs", json=body, headers=headers)
    assert (first.status_code, again.status_code) == (202, 202)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    changed = client.post(
        f"/v1/threads/{thread_id}/runs", json=body | {"input": "bye"}, headers=headers
    )
    elsewhere = client.post(
        f"/v1/threads/{new_thread(client, tenant)}/runs", json=body, headers=headers
    )
    assert (changed.status_code, elsewhere.status_code) == (422, 422)
    thread = client.get(f"/v1/threads/{thread_id}", headers=tenant.headers).json()
    assert thread["turns"] == 1


def test_a_failed_turn_is_not_retried_while_a_later_turn_is_unfinished(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    thread_id = new_thread(client, tenant)
    script = [tool_turn("upsert_record", key="k"), {"content": "never"}]
    failing = {"model": "scripted", "model_options": {"script": script}, "max_steps": 1}
    response = client.post(
        f"/v1/threads/{thread_id}/runs", json={"input": "one"} | failing, headers=tenant.headers
    )
    first = response.json()["id"]
    assert drive(first) == "failed"
    second = turn(client, tenant, thread_id, "two")
    retried = client.post(f"/v1/tasks/{first}/retry", headers=tenant.headers)
    assert retried.status_code == 409, retried.text
    with transaction() as session:
        assert session.get(Task, first).status == "failed"  # type: ignore[union-attr]
        assert session.get(Task, second["id"]).status == "queued"  # type: ignore[union-attr]


class Connected:
    """A request that stays connected (the stream's only question to it)."""

    async def is_disconnected(self) -> bool:
        return False


def events_of(tenant: TenantHandle, thread_id: str, *, after: str | None, count: int) -> list[str]:
    """The first ``count`` events the thread's stream sends (``after``: Last-Event-ID), as
    ``<id> <type>``."""
    return events_until(tenant, thread_id, after=after, until=lambda got: len(got) == count)


def events_until(
    tenant: TenantHandle,
    thread_id: str,
    *,
    after: str | None,
    until: Callable[[list[str]], bool],
) -> list[str]:
    """The events the thread's stream sends (``after``: Last-Event-ID) as ``<id> <type>``,
    until ``until`` says it has them all."""
    from api.routes import thread_events

    async def read() -> list[str]:
        start = thread_events.parse_position(after)
        stream = thread_events._stream(
            Connected(),  # type: ignore[arg-type]
            tenant.id,
            thread_id,
            start,
            approval_links=False,
        )
        got: list[str] = []
        try:
            async for chunk in stream:
                if chunk.startswith("id: "):
                    lines = chunk.splitlines()
                    got.append(f"{lines[0][4:]} {lines[1][7:]}")
                if until(got):
                    break
        finally:
            await stream.aclose()
        return got

    return asyncio.run(asyncio.wait_for(read(), timeout=60))


def test_one_stream_carries_every_turns_events_in_order_and_resumes_after_any(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    thread_id = new_thread(client, tenant)
    logs: list[list[str]] = []
    for k in (1, 2, 3):
        task_id = turn(client, tenant, thread_id, f"message {k}")["id"]
        drive(task_id)
        events = client.get(f"/v1/tasks/{task_id}/events", headers=tenant.headers).text
        logs.append([line[7:] for line in events.splitlines() if line.startswith("event: ")])
    expected = [
        f"{k}:{seq} {type_}" for k, log in enumerate(logs, 1) for seq, type_ in enumerate(log, 1)
    ]
    assert expected[-1].endswith("task.succeeded")
    assert events_of(tenant, thread_id, after=None, count=len(expected)) == expected
    resumed = events_of(tenant, thread_id, after=expected[4].split()[0], count=len(expected) - 5)
    assert resumed == expected[5:]
    last_of_first = f"1:{len(logs[0])}"
    assert events_of(tenant, thread_id, after=last_of_first, count=1) == [expected[len(logs[0])]]


def test_a_turn_waiting_for_approval_holds_the_next_turn_until_it_ends(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    """Approvals apply to turns as to any task, and a turn that waits for a person still
    keeps the thread's next turn waiting (it never runs while the decision is pending)."""
    from tests.helpers import admit

    thread_id = new_thread(client, tenant)
    script = [tool_turn("wire_money", to="alice", amount=900), {"content": "wired"}]
    body = {"input": "pay alice", "model": "scripted", "model_options": {"script": script}}
    first = client.post(f"/v1/threads/{thread_id}/runs", json=body, headers=tenant.headers)
    assert drive(first.json()["id"]) == "awaiting_approval"
    thread = client.get(f"/v1/threads/{thread_id}", headers=tenant.headers).json()
    assert thread["status"] == "awaiting_approval"

    second = turn(client, tenant, thread_id, "and then?")
    admit()
    with transaction() as session:
        held = session.get(Task, second["id"])
        assert held is not None
        assert (held.turn_held, held.admitted_ms) == (True, None)

    decided = client.post(
        f"/v1/tasks/{first.json()['id']}/approvals/1-0",
        json={"decision": "approve"},
        headers=tenant.headers,
    )
    assert decided.status_code == 200, decided.text
    assert drive(first.json()["id"]) == "succeeded"
    admit()
    assert drive(second["id"]) == "succeeded"
    thread = client.get(f"/v1/threads/{thread_id}", headers=tenant.headers).json()
    assert (thread["status"], thread["latest_turn"]["id"]) == ("idle", second["id"])


def test_the_stream_outlives_a_turn_and_carries_the_next_one_live(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    import threading

    thread_id = new_thread(client, tenant)
    first = turn(client, tenant, thread_id, "message 1")["id"]
    drive(first)
    later: list[str] = []

    def next_turn() -> None:  # once the stream has sent turn 1 and waits
        time.sleep(1.0)
        later.append(turn(client, tenant, thread_id, "message 2")["id"])
        drive(later[0])

    sender = threading.Thread(target=next_turn)
    sender.start()
    got = events_until(
        tenant,
        thread_id,
        after=None,
        until=lambda got: got[-1].startswith("2:") and got[-1].endswith(" task.succeeded"),
    )
    sender.join(60)
    logs = [
        [
            line[7:]
            for line in client.get(
                f"/v1/tasks/{task_id}/events", headers=tenant.headers
            ).text.splitlines()
            if line.startswith("event: ")
        ]
        for task_id in (first, later[0])
    ]
    assert got == [
        f"{k}:{seq} {type_}" for k, log in enumerate(logs, 1) for seq, type_ in enumerate(log, 1)
    ]
