"""Batches (``POST /v1/tasks/batch``, ``GET /v1/batches/{id}``) on each backend: many tasks
accepted in one request and one transaction, each bad item refused on its own, a repeat that
creates nothing, a long poll that answers once every task has ended, and another tenant's
batch not found."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text
from typer.testing import CliRunner

from shared.store.db import transaction
from shared.store.tables import Batch, Task
from tests.conftest import Configure, TenantHandle
from tests.helpers import TERMINAL, admit, scripted_task
from tests.integration.test_api import assert_problem, task_count
from tests.integration.test_scheduling import settings

pytestmark = pytest.mark.backends("postgresql", "sqlite")


def one_step(n: int) -> dict[str, Any]:
    """A task of one scripted step, answering ``n``."""
    return scripted_task([{"content": f"answer {n}"}], input=f"task {n}")


def post_batch(
    client: TestClient, tenant: TenantHandle, tasks: list[Any], *, key: str | None = None
) -> Any:
    headers = tenant.headers | ({"Idempotency-Key": key} if key else {})
    return client.post("/v1/tasks/batch", json={"tasks": tasks}, headers=headers)


def accepted(response: Any) -> dict[str, Any]:
    assert response.status_code == 202, response.text
    body: dict[str, Any] = response.json()
    assert response.headers["location"] == f"/v1/batches/{body['batch_id']}"
    return body


def batch_count(tenant_id: str) -> int:
    with transaction() as session:
        count = session.scalar(
            select(func.count()).select_from(Batch).where(Batch.tenant_id == tenant_id)
        )
    assert count is not None
    return count


def run_all(drive: Callable[..., str], task_ids: list[str]) -> list[str]:
    """Admit the backlog (as the dispatcher's rounds do) and run each task to its end."""
    admit()
    return [drive(task_id) for task_id in task_ids]


def test_a_batch_of_a_thousand_tasks_is_one_request_one_transaction_and_all_succeed(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], backend: str
) -> None:
    body = accepted(post_batch(client, tenant, [one_step(n) for n in range(1000)]))

    assert (body["task_count"], body["refused_count"]) == (1000, 0)
    assert [item["index"] for item in body["items"]] == list(range(1000))
    assert {item["status"] for item in body["items"]} == {"queued"}
    ids = [item["task_id"] for item in body["items"]]
    assert len(set(ids)) == 1000
    assert task_count(tenant.id) == 1000
    if backend == "postgresql":
        # Rows written by one transaction carry its id (xmin) until they are next updated.
        with transaction() as session:
            writers = session.scalar(
                text("SELECT count(DISTINCT xmin::text) FROM tasks WHERE batch_id = :b"),
                {"b": body["batch_id"]},
            )
        assert writers == 1

    assert run_all(drive, ids) == ["succeeded"] * 1000

    batch = client.get(f"/v1/batches/{body['batch_id']}", headers=tenant.headers).json()
    assert batch["completed"] is True
    assert batch["counts"] == {"succeeded": 1000}
    assert sorted(batch["tasks"]["succeeded"]) == sorted(ids)
    task = client.get(f"/v1/tasks/{ids[7]}", headers=tenant.headers).json()
    assert (task["result"], task["batch_id"]) == ({"output": "answer 7"}, body["batch_id"])


def test_each_bad_item_is_refused_in_its_own_answer_and_the_rest_go_ahead(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    items = [
        one_step(0),
        {"model": "scripted"},  # no input
        one_step(2) | {"agent": "nobody"},
        one_step(3) | {"tools": ["calculator", "no_such_tool"]},
        one_step(4) | {"idempotency_key": 42},
        one_step(5) | {"max_steps": 0},
        one_step(6),
    ]
    body = accepted(post_batch(client, tenant, items))

    assert (body["task_count"], body["refused_count"]) == (2, 5)
    good = [body["items"][0], body["items"][6]]
    assert all(item["status"] == "queued" and item["error"] is None for item in good)
    refused = {item["index"]: item["error"] for item in body["items"] if item["error"]}
    assert {i: [e["field"] for e in error["errors"]] for i, error in refused.items()} == {
        1: ["tasks[1].input"],
        2: ["tasks[2].agent"],
        3: ["tasks[3].tools[1]"],
        4: ["tasks[4].idempotency_key"],
        5: ["tasks[5].max_steps"],
    }
    for index, error in refused.items():
        assert error["status"] == 422
        assert error["type"] == "urn:ratchet:problem:validation-error"
        assert error["detail"].startswith(f"tasks[{index}]")
        assert error["errors"][0]["pointer"].startswith(f"#/tasks/{index}/")
        assert body["items"][index]["task_id"] is None
    assert task_count(tenant.id) == 2
    assert run_all(drive, [item["task_id"] for item in good]) == ["succeeded"] * 2
    batch = client.get(f"/v1/batches/{body['batch_id']}", headers=tenant.headers).json()
    assert (batch["task_count"], batch["refused_count"], batch["completed"]) == (2, 5, True)


def test_a_repeated_batch_creates_nothing_and_answers_the_same_batch(
    client: TestClient, tenant: TenantHandle
) -> None:
    items = [one_step(n) for n in range(5)] + [{"input": ""}]
    first = accepted(post_batch(client, tenant, items, key="nightly-1"))
    assert (task_count(tenant.id), batch_count(tenant.id)) == (5, 1)

    again = post_batch(client, tenant, items, key="nightly-1")

    assert again.headers["idempotent-replayed"] == "true"
    assert accepted(again) == first
    assert (task_count(tenant.id), batch_count(tenant.id)) == (5, 1)
    changed = post_batch(client, tenant, items[:4], key="nightly-1")
    assert assert_problem(changed, 422)["type"] == "urn:ratchet:problem:idempotency-key-reused"
    assert (task_count(tenant.id), batch_count(tenant.id)) == (5, 1)


def test_an_items_own_key_finds_its_task_across_batches_and_single_submissions(
    client: TestClient, tenant: TenantHandle
) -> None:
    single = client.post(
        "/v1/tasks", json=one_step(0), headers=tenant.headers | {"Idempotency-Key": "order-0"}
    ).json()
    first = accepted(
        post_batch(
            client,
            tenant,
            [
                one_step(0) | {"idempotency_key": "order-0"},
                one_step(1) | {"idempotency_key": "order-1"},
                one_step(1) | {"idempotency_key": "order-1"},  # the item before's task
            ],
        )
    )
    assert [(i["task_id"], i["replayed"]) for i in first["items"]] == [
        (single["id"], True),
        (first["items"][1]["task_id"], False),
        (first["items"][1]["task_id"], True),
    ]
    assert first["task_count"] == 1
    assert task_count(tenant.id) == 2

    second = accepted(
        post_batch(
            client,
            tenant,
            [
                one_step(1) | {"idempotency_key": "order-1"},
                one_step(9) | {"idempotency_key": "order-0"},
            ],
        )
    )

    assert (second["items"][0]["task_id"], second["items"][0]["replayed"]) == (
        first["items"][1]["task_id"],
        True,
    )
    reused = second["items"][1]["error"]
    assert reused["type"] == "urn:ratchet:problem:idempotency-key-reused"
    assert [e["field"] for e in reused["errors"]] == ["tasks[1].idempotency_key"]
    assert (second["task_count"], second["refused_count"]) == (0, 1)
    assert task_count(tenant.id) == 2


@contextmanager
def run_later(drive: Callable[..., str], task_ids: list[str], delay: float = 0.5) -> Iterator[None]:
    """Run the tasks to their end from a background thread, once the caller is waiting."""
    failures: list[BaseException] = []

    def run() -> None:
        time.sleep(delay)
        try:
            run_all(drive, task_ids)
        except BaseException as exc:  # surfaced in the test's thread below
            failures.append(exc)

    thread = threading.Thread(target=run, name="run-batch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(timeout=60)
    if failures:
        raise failures[0]


def test_a_long_poll_answers_once_every_task_of_the_batch_has_ended(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from api.routes import batches as batch_routes

    # No fallback poll within the wait: only the tasks' wake-ups can answer before it ends.
    monkeypatch.setattr(batch_routes, "FALLBACK_POLL_SECONDS", 3600.0)
    body = accepted(post_batch(client, tenant, [one_step(n) for n in range(3)]))
    ids = [item["task_id"] for item in body["items"]]

    with run_later(drive, ids):
        started = time.monotonic()
        response = client.get(
            f"/v1/batches/{body['batch_id']}", params={"wait": 30}, headers=tenant.headers
        )
        answered = time.monotonic()

    assert response.status_code == 200, response.text
    batch = response.json()
    assert batch["completed"] is True
    assert batch["counts"] == {"succeeded": 3}
    assert answered - started < 25  # woken by the last task's end, well before the wait ends
    with transaction() as session:
        statuses = session.scalars(select(Task.status).where(Task.id.in_(ids))).all()
    assert set(statuses) <= set(TERMINAL)


def test_a_long_poll_on_a_batch_that_does_not_end_answers_at_the_timeout(
    client: TestClient, tenant: TenantHandle
) -> None:
    body = accepted(post_batch(client, tenant, [one_step(0)]))  # no worker runs it

    response = client.get(
        f"/v1/batches/{body['batch_id']}", params={"wait": 0.5}, headers=tenant.headers
    )

    assert response.status_code == 200
    assert (response.json()["completed"], response.json()["counts"]) == (False, {"queued": 1})


def test_another_tenants_batch_is_not_found(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    owner, other = make_tenant(), make_tenant()
    body = accepted(post_batch(client, owner, [one_step(0)]))

    for wait in (0, 1):
        response = client.get(
            f"/v1/batches/{body['batch_id']}", params={"wait": wait}, headers=other.headers
        )
        assert_problem(response, 404)
    assert client.get(f"/v1/batches/{body['batch_id']}", headers=owner.headers).status_code == 200


def test_a_batch_over_the_most_tasks_is_a_422_and_creates_nothing(
    client: TestClient, tenant: TenantHandle, configure: Configure
) -> None:
    configure(RATCHET_BATCH_MAX_TASKS="5")

    response = post_batch(client, tenant, [one_step(n) for n in range(6)])

    problem = assert_problem(response, 422)
    assert [e["field"] for e in problem["errors"]] == ["tasks"]
    assert "RATCHET_BATCH_MAX_TASKS" in problem["detail"]
    assert (task_count(tenant.id), batch_count(tenant.id)) == (0, 0)
    accepted(post_batch(client, tenant, [one_step(n) for n in range(5)]))


@pytest.mark.parametrize("body", [{}, {"tasks": []}, {"tasks": "all"}, {"tasks": [1]}, []])
def test_a_body_that_is_no_list_of_objects_is_a_422(
    client: TestClient, tenant: TenantHandle, body: Any
) -> None:
    response = client.post("/v1/tasks/batch", json=body, headers=tenant.headers)

    assert_problem(response, 422)
    assert batch_count(tenant.id) == 0


def test_submitting_needs_tasks_write_and_reading_tasks_read(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    writer, reader = make_tenant(("tasks:write",)), make_tenant(("tasks:read",))

    assert_problem(post_batch(client, reader, [one_step(0)]), 403)
    body = accepted(post_batch(client, writer, [one_step(0)]))
    assert_problem(client.get(f"/v1/batches/{body['batch_id']}", headers=writer.headers), 403)


def test_a_batch_that_would_pass_the_queue_cap_is_refused_whole(
    client: TestClient, tenant: TenantHandle
) -> None:
    with settings(concurrency={"tenants": {tenant.name: {"max_queued": 3}}}):
        refused = post_batch(client, tenant, [one_step(n) for n in range(4)])

        assert "max_queued 3" in assert_problem(refused, 429)["detail"]
        assert int(refused.headers["retry-after"]) >= 1
        assert (task_count(tenant.id), batch_count(tenant.id)) == (0, 0)
        assert (
            accepted(post_batch(client, tenant, [one_step(n) for n in range(3)]))["task_count"] == 3
        )


def over_http(client: TestClient, tenant: TenantHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ratchet batch`` (an HTTP client of the API) talks to this app, with the key."""
    from ratchet import cli_batches
    from ratchet import client as ratchet_client

    def api_client() -> ratchet_client.Client:
        through = ratchet_client.Client("http://testserver", tenant.key)
        through._http = TestClient(client.app, headers=tenant.headers)
        return through

    monkeypatch.setattr(cli_batches, "api_client", api_client)


# The client gives a long poll a longer timeout, which the ASGI test transport does not take.
TIMEOUT_UNUSED = "ignore:You should not use the 'timeout' argument"


@pytest.mark.filterwarnings(TIMEOUT_UNUSED)
def test_the_cli_submits_a_jsonl_file_as_one_batch_and_waits_for_it(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from ratchet.cli import app as cli

    over_http(client, tenant, monkeypatch)
    lines = [json.dumps(one_step(n)) for n in range(3)]
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text("\n".join([*lines[:2], "", lines[2]]) + "\n")

    submitted = CliRunner().invoke(cli, ["batch", "submit", str(jsonl)])
    assert submitted.exit_code == 0, submitted.output
    answer = json.loads(submitted.stdout)
    ids = [item["task_id"] for item in answer["items"]]
    assert answer["task_count"] == 3
    with run_later(drive, ids, delay=0.2):
        got = CliRunner().invoke(cli, ["batch", "get", answer["batch_id"], "--wait", "30"])
    assert got.exit_code == 0, got.output
    assert json.loads(got.stdout)["counts"] == {"succeeded": 3}

    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "\n[1, 2]\n")
    refused = CliRunner().invoke(cli, ["batch", "submit", str(bad)])
    assert refused.exit_code == 2
    assert f"{bad}:2: expected a JSON object" in refused.output
    assert batch_count(tenant.id) == 1


@pytest.mark.filterwarnings(TIMEOUT_UNUSED)
def test_the_cli_waits_for_a_batch_and_says_by_its_status_whether_all_succeeded(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from ratchet.cli import app as cli

    over_http(client, tenant, monkeypatch)
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text(json.dumps(one_step(0)) + "\n" + json.dumps({"input": ""}) + "\n")

    def run_once_submitted() -> None:
        for _ in range(600):  # the CLI's batch, once it is there
            with transaction() as session:
                ids = session.scalars(select(Task.id).where(Task.tenant_id == tenant.id)).all()
            if ids:
                run_all(drive, list(ids))
                return
            time.sleep(0.05)

    runner = threading.Thread(target=run_once_submitted, daemon=True)
    runner.start()
    waited = CliRunner().invoke(cli, ["batch", "submit", str(jsonl), "--wait"])
    runner.join(timeout=30)

    batch = json.loads(waited.stdout)
    assert (batch["completed"], batch["counts"], batch["refused_count"]) == (
        True,
        {"succeeded": 1},
        1,
    )
    assert waited.exit_code == 1  # an item was refused
