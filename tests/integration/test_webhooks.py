"""Webhooks on each backend (PostgreSQL with Redis, and SQLite), received over real HTTP and
checked the way a receiver would: with the ``standardwebhooks`` package and the secret
``ratchet webhooks secret`` prints.

The API runs in-process and a task's steps are driven inline; as in a worker, each commit hands
its deliveries to the background sender of this process. Where a test must decide when a
webhook goes out, it holds those hand-offs back (as if the worker died right after the commit)
and runs the sender itself. The same paths run in worker processes in
``tests/e2e/test_delivery.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update
from standardwebhooks.webhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError as ReferenceVerificationError

from shared.settings import get_settings
from shared.store.db import transaction
from shared.store.outbox import DeliveryStatus
from shared.store.tables import Task, TaskEvent, WebhookDelivery, WebhookEndpoint
from shared.webhooks import endpoints as webhook_endpoints
from shared.webhooks import secrets as webhook_secrets
from shared.webhooks.signing import signature
from tests.conftest import Configure, TenantHandle
from tests.fakes.receiver import Received, WebhookReceiver
from tests.helpers import calculator_script, scripted_task
from workers import webhook_sender

pytestmark = pytest.mark.backends("postgresql", "sqlite")

PROBLEM_JSON = "application/problem+json"
EVERY_EVENT = [
    "task.queued",
    "task.started",
    "step.model_response",
    "step.tool_call",
    "step.completed",
    "task.succeeded",
]


# --- helpers ----------------------------------------------------------------------------------


def ratchet(*args: str, cwd: Path) -> str:
    """Run the ``ratchet`` command with this run's settings; return its stdout, stripped."""
    command = shutil.which("ratchet", path=str(Path(sys.executable).parent)) or "ratchet"
    done = subprocess.run(
        [command, *args],
        check=False,
        cwd=cwd,  # away from any .env in the checkout
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"ratchet {' '.join(args)}: {done.stderr}"
    return done.stdout.strip()


def current_secret(tenant: TenantHandle) -> str:
    with transaction() as session:
        return webhook_secrets.current(session, tenant.id)


def submit(client: TestClient, tenant: TenantHandle, **extra: Any) -> dict[str, Any]:
    response = client.post(
        "/v1/tasks", json=scripted_task(calculator_script(2), **extra), headers=tenant.headers
    )
    assert response.status_code == 202, response.text
    task: dict[str, Any] = response.json()
    return task


def delivery_rows(task_id: str) -> list[WebhookDelivery]:
    with transaction() as session:
        rows = session.scalars(
            select(WebhookDelivery)
            .where(WebhookDelivery.task_id == task_id)
            .order_by(WebhookDelivery.event_seq)
        ).all()
        session.expunge_all()
    return list(rows)


def send_pending(task_id: str) -> list[str | None]:
    """Run the sender on every pending delivery of the task, in event order."""
    return [
        webhook_sender.attempt(row.id)
        for row in delivery_rows(task_id)
        if row.status == DeliveryStatus.PENDING
    ]


def wait_for_deliveries(
    task_id: str, done: Callable[[list[WebhookDelivery]], bool], timeout: float = 10.0
) -> list[WebhookDelivery]:
    """Poll the task's deliveries until ``done`` says the background sender has finished."""
    deadline = time.monotonic() + timeout
    while True:
        rows = delivery_rows(task_id)
        if done(rows):
            return rows
        if time.monotonic() > deadline:
            raise AssertionError(f"deliveries still {[(r.event_type, r.status) for r in rows]}")
        time.sleep(0.02)


def statuses(*expected: str) -> Callable[[list[WebhookDelivery]], bool]:
    return lambda rows: [r.status for r in rows] == list(expected)


def settled(rows: list[WebhookDelivery]) -> bool:
    """Every delivery has its outcome: none is due or being sent."""
    return bool(rows) and all(
        r.status not in (DeliveryStatus.PENDING, DeliveryStatus.SENDING) for r in rows
    )


def waiting_to_retry(rows: list[WebhookDelivery]) -> bool:
    return bool(rows) and all(r.status == DeliveryStatus.PENDING and r.attempts > 0 for r in rows)


def deliveries(client: TestClient, tenant: TenantHandle, task_id: str) -> list[dict[str, Any]]:
    response = client.get(f"/v1/tasks/{task_id}/webhook-deliveries", headers=tenant.headers)
    assert response.status_code == 200, response.text
    items: list[dict[str, Any]] = response.json()["items"]
    return items


def assert_problem(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    return body


def rows_of(tenant_id: str, model: Any) -> int:
    with transaction() as session:
        count = session.scalar(
            select(func.count()).select_from(model).where(model.tenant_id == tenant_id)
        )
    assert count is not None
    return count


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as started:
        yield started


@pytest.fixture
def held_back(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Deliveries committed from now on are not handed to the background sender; their ids
    are collected here instead, and they stay pending until the test sends them."""
    held: list[str] = []
    monkeypatch.setattr(webhook_sender, "dispatch", held.extend)
    return held


@pytest.fixture
def delivered(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    receiver: WebhookReceiver,
) -> tuple[dict[str, Any], Received]:
    """A task that succeeded and the one ``task.succeeded`` webhook its receiver got."""
    task = submit(client, tenant, webhook={"url": receiver.url()})
    assert drive(task["id"]) == "succeeded"
    [request] = receiver.wait_for(1)
    wait_for_deliveries(task["id"], statuses(DeliveryStatus.DELIVERED))
    return task, request


# --- signatures -------------------------------------------------------------------------------


def test_a_delivery_verifies_with_standardwebhooks_and_the_cli_secret(
    client: TestClient,
    tenant: TenantHandle,
    delivered: tuple[dict[str, Any], Received],
    tmp_path: Path,
) -> None:
    task, request = delivered
    secret = ratchet("webhooks", "secret", "--tenant", tenant.name, cwd=tmp_path)

    payload = Webhook(secret).verify(request.body, dict(request.headers))

    assert payload["type"] == "task.succeeded"
    assert payload["data"]["id"] == task["id"]
    assert payload["data"]["status"] == "succeeded"
    assert payload["data"]["result"] == {"output": "done after 1 calculations"}
    assert request.headers["content-type"] == "application/json"
    [listed] = deliveries(client, tenant, task["id"])
    assert request.webhook_id == listed["webhook_id"] == f"msg_{listed['id']}"
    assert listed["status"] == "delivered"
    assert secret == current_secret(tenant)  # alone on stdout


def test_a_tampered_body_fails_verification(
    tenant: TenantHandle, delivered: tuple[dict[str, Any], Received]
) -> None:
    _, request = delivered
    secret = current_secret(tenant)
    tampered = request.body.replace(b'"succeeded"', b'"failed"', 1)
    assert tampered != request.body

    with pytest.raises(ReferenceVerificationError, match="No matching signature"):
        Webhook(secret).verify(tampered, dict(request.headers))


def test_a_delivery_ten_minutes_old_fails_verification(
    tenant: TenantHandle, delivered: tuple[dict[str, Any], Received]
) -> None:
    _, request = delivered
    secret = current_secret(tenant)
    old = int(request.headers["webhook-timestamp"]) - 600
    replayed = {
        **request.headers,
        "webhook-timestamp": str(old),
        # Correctly signed for that moment: only its age is wrong.
        "webhook-signature": signature(secret, request.webhook_id, old, request.body),
    }

    with pytest.raises(ReferenceVerificationError, match="too old"):
        Webhook(secret).verify(request.body, replayed)


def test_another_tenants_secret_does_not_verify(
    make_tenant: Callable[..., TenantHandle], delivered: tuple[dict[str, Any], Received]
) -> None:
    _, request = delivered
    other = current_secret(make_tenant())

    with pytest.raises(ReferenceVerificationError):
        Webhook(other).verify(request.body, dict(request.headers))


def test_after_rotation_deliveries_carry_both_signatures_and_both_secrets_verify(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    receiver: WebhookReceiver,
    tmp_path: Path,
) -> None:
    old = current_secret(tenant)
    new = ratchet("webhooks", "secret", "--tenant", tenant.name, "--rotate", cwd=tmp_path)
    assert new.startswith("whsec_")
    assert new != old
    assert current_secret(tenant) == new

    task = submit(client, tenant, webhook={"url": receiver.url()})
    drive(task["id"])
    [request] = receiver.wait_for(1)

    signatures = request.headers["webhook-signature"].split(" ")
    assert len(signatures) == 2
    assert all(s.startswith("v1,") for s in signatures)
    for secret in (old, new):
        assert (
            Webhook(secret).verify(request.body, dict(request.headers))["data"]["id"] == task["id"]
        )


def test_once_the_overlap_is_over_only_the_new_secret_signs(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    receiver: WebhookReceiver,
) -> None:
    old = current_secret(tenant)
    with transaction() as session:
        new = webhook_secrets.rotate(session, tenant.id, overlap=timedelta(0))

    task = submit(client, tenant, webhook={"url": receiver.url()})
    drive(task["id"])
    [request] = receiver.wait_for(1)

    assert len(request.headers["webhook-signature"].split(" ")) == 1
    Webhook(new).verify(request.body, dict(request.headers))
    with pytest.raises(ReferenceVerificationError):
        Webhook(old).verify(request.body, dict(request.headers))


# --- SSRF -------------------------------------------------------------------------------------


@contextmanager
def nothing_allow_listed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The operator allow-lists no webhook host: loopback and private receivers are refused."""
    try:
        with monkeypatch.context() as patched:
            patched.setenv("RATCHET_WEBHOOK_ALLOWED_HOSTS", "")
            get_settings.cache_clear()
            yield
    finally:
        get_settings.cache_clear()


@pytest.fixture
def no_webhook_allow_list(configure: Configure) -> None:
    """The operator allow-lists no webhook host, for the whole test."""
    configure(RATCHET_WEBHOOK_ALLOWED_HOSTS="")


INTERNAL_URLS = [
    "http://127.0.0.1",
    "http://169.254.169.254",
    "http://10.0.0.1",
    "http://[::1]",
    "http://2130706433",
    "http://[::ffff:127.0.0.1]",
]


@pytest.mark.usefixtures("no_webhook_allow_list")
@pytest.mark.parametrize(
    "url",
    # Plain http is refused for any host off the allow-list; https reaches the address check.
    [*INTERNAL_URLS, *(u.replace("http://", "https://") + "/hook" for u in INTERNAL_URLS)],
)
def test_internal_webhook_urls_are_refused_at_submit(
    client: TestClient, tenant: TenantHandle, url: str
) -> None:
    response = client.post(
        "/v1/tasks", json={"input": "hi", "webhook": {"url": url}}, headers=tenant.headers
    )

    problem = assert_problem(response, 422)
    assert [e["field"] for e in problem["errors"]] == ["webhook.url"], problem
    if url.startswith("https://"):
        assert "non-public address" in problem["detail"], problem
    listed = client.get("/v1/tasks", headers=tenant.headers)
    assert listed.json()["items"] == []
    assert rows_of(tenant.id, Task) == 0
    assert rows_of(tenant.id, WebhookDelivery) == 0


@pytest.mark.usefixtures("no_webhook_allow_list")
def test_a_host_that_resolves_to_loopback_is_refused_at_submit(
    client: TestClient, tenant: TenantHandle
) -> None:
    response = client.post(
        "/v1/tasks",
        json={"input": "hi", "webhook": {"url": "https://localhost/hook"}},
        headers=tenant.headers,
    )

    assert "non-public address" in assert_problem(response, 422)["detail"]
    assert rows_of(tenant.id, Task) == 0


def test_a_url_no_longer_allowed_at_send_time_is_not_requested(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    receiver: WebhookReceiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    task = submit(client, tenant, webhook={"url": receiver.url()})
    with nothing_allow_listed(monkeypatch):
        drive(task["id"])
        [row] = wait_for_deliveries(task["id"], statuses(DeliveryStatus.FAILED))

    assert receiver.received() == []
    assert row.last_error is not None
    assert "egress policy" in row.last_error


def test_the_refusal_at_send_time_is_shown_and_a_redelivery_answers_with_the_delivery(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    receiver: WebhookReceiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    task = submit(client, tenant, webhook={"url": receiver.url()})
    with nothing_allow_listed(monkeypatch):
        drive(task["id"])
        wait_for_deliveries(task["id"], statuses(DeliveryStatus.FAILED))

    [listed] = deliveries(client, tenant, task["id"])
    assert listed["attempts"] == []  # no request went out …
    assert "egress policy" in listed["last_error"]  # … and the listing says why

    # A receiver that answered once: its redelivery shows that attempt, as it stands.
    other = submit(client, tenant, webhook={"url": receiver.url()})
    drive(other["id"])
    receiver.wait_for(1)
    [sent] = wait_for_deliveries(other["id"], statuses(DeliveryStatus.DELIVERED))
    response = client.post(f"/v1/webhook-deliveries/{sent.id}/redeliver", headers=tenant.headers)
    assert response.status_code == 202, response.text
    redelivery = response.json()
    assert [a["status_code"] for a in redelivery["attempts"]] == [200]
    assert redelivery["status"] == "pending"


@pytest.mark.usefixtures("held_back")
def test_every_webhook_body_names_its_task_and_a_step_event_its_step(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    receiver: WebhookReceiver,
) -> None:
    task = submit(client, tenant, webhook={"url": receiver.url(), "events": EVERY_EVENT})
    drive(task["id"])
    send_pending(task["id"])

    bodies = [r.json() for r in receiver.received()]
    assert {b["type"] for b in bodies} >= {"step.model_response", "step.tool_call"}, bodies
    assert all(b["task_id"] == task["id"] for b in bodies), bodies
    assert all(b["data"]["step"] >= 1 for b in bodies if b["type"].startswith("step.")), bodies
    # A model response and a call's outcome go out whole (their log rows name only their step
    # or call), as the stream reads them.
    events = client.get(f"/v1/tasks/{task['id']}/events", headers=tenant.headers).text
    for type_ in ("step.model_response", "step.tool_call"):
        sent = [b["data"] for b in bodies if b["type"] == type_]
        read = [
            json.loads(block.split("data: ", 1)[1])
            for block in events.split("\n\n")
            if f"event: {type_}" in block
        ]
        assert sent == read, (sent, read)
    responses = [b["data"] for b in bodies if b["type"] == "step.model_response"]
    assert all(d["usage"]["input_tokens"] > 0 and "tool_calls" in d for d in responses)
    outcomes = [b["data"] for b in bodies if b["type"] == "step.tool_call"]
    assert all(d["status"] == "succeeded" and "result" in d for d in outcomes), outcomes


# --- 410 Gone ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("held_back")
def test_410_disables_the_delivery_and_the_pending_ones_to_that_url(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    receiver: WebhookReceiver,
) -> None:
    receiver.respond("/gone", then=410)
    task = submit(client, tenant, webhook={"url": receiver.url("/gone"), "events": EVERY_EVENT})
    drive(task["id"])
    pending = delivery_rows(task["id"])
    assert len(pending) > 5
    assert {r.status for r in pending} == {DeliveryStatus.PENDING}

    sent = send_pending(task["id"])

    # The first went out; the rest were disabled with it, so none was the sender's to send.
    assert sent == [DeliveryStatus.DISABLED] + [None] * (len(pending) - 1)
    assert len(receiver.received()) == 1
    listed = deliveries(client, tenant, task["id"])
    assert {d["status"] for d in listed} == {"disabled"}
    assert [len(d["attempts"]) for d in listed] == [1] + [0] * (len(listed) - 1)
    assert listed[0]["attempts"][0]["status_code"] == 410


def test_after_a_410_later_events_of_the_task_are_not_sent_to_that_url(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    receiver: WebhookReceiver,
) -> None:
    receiver.respond("/gone", then=410)
    task = submit(client, tenant, webhook={"url": receiver.url("/gone"), "events": EVERY_EVENT})
    assert send_pending(task["id"]) == [
        DeliveryStatus.DISABLED
    ]  # task.queued: the receiver is gone

    drive(task["id"])  # the task's later events come after the 410
    rows = wait_for_deliveries(task["id"], settled)

    sent = [r.json()["type"] for r in receiver.received()]
    assert sent == ["task.queued"], f"sent to a receiver that answered 410 Gone: {sent[1:]}"
    assert {r.status for r in rows} == {DeliveryStatus.DISABLED}


def test_after_a_410_the_rest_of_the_running_step_sends_nothing_to_that_url(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    receiver: WebhookReceiver,
) -> None:
    receiver.respond("/gone", then=410)
    # The model takes a while: task.started's webhook is answered 410 before the step's
    # model response commits.
    script = [{**turn, "delay_ms": 300} for turn in calculator_script(2)]
    body = scripted_task(script, webhook={"url": receiver.url("/gone"), "events": EVERY_EVENT})
    response = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert response.status_code == 202, response.text
    task_id = response.json()["id"]

    drive(task_id)
    rows = wait_for_deliveries(task_id, settled)

    sent = [r.json()["type"] for r in receiver.received()]
    assert sent == ["task.started"], f"sent to a receiver that answered 410 Gone: {sent[1:]}"
    assert {r.status for r in rows} == {DeliveryStatus.DISABLED}


def test_410_disables_a_tenant_endpoint_for_the_tasks_after_it(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    receiver: WebhookReceiver,
) -> None:
    receiver.respond("/endpoint", then=410)
    with transaction() as session:
        endpoint_id = webhook_endpoints.create(
            session, tenant.id, url=receiver.url("/endpoint"), events=["task.succeeded"]
        ).id
    first = submit(client, tenant)
    drive(first["id"])
    wait_for_deliveries(first["id"], statuses(DeliveryStatus.DISABLED))

    second = submit(client, tenant)
    drive(second["id"])

    assert delivery_rows(second["id"]) == []
    assert len(receiver.received()) == 1
    with transaction() as session:
        endpoint = session.get(WebhookEndpoint, endpoint_id)
        assert endpoint is not None
        assert endpoint.enabled is False
        assert endpoint.disabled_reason is not None
        assert "410" in endpoint.disabled_reason


# --- the delivery log -------------------------------------------------------------------------


def test_the_attempt_log_records_status_latency_and_error(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    receiver: WebhookReceiver,
) -> None:
    receiver.respond("/flaky", 503)
    task = submit(client, tenant, webhook={"url": receiver.url("/flaky")})
    drive(task["id"])
    receiver.wait_for(1)
    # The next try is 5 s away on the default schedule; make it due now and send it.
    [row] = wait_for_deliveries(task["id"], waiting_to_retry)
    with transaction() as session:
        session.execute(
            update(WebhookDelivery).where(WebhookDelivery.id == row.id).values(next_attempt_ms=0)
        )
    assert webhook_sender.attempt(row.id) == DeliveryStatus.DELIVERED

    [listed] = deliveries(client, tenant, task["id"])
    first, second = listed["attempts"]
    assert (first["number"], first["status_code"]) == (1, 503)
    assert (second["number"], second["status_code"]) == (2, 200)
    assert "503" in first["error"]
    assert second["error"] is None
    for attempt in (first, second):
        assert isinstance(attempt["latency_ms"], int)
        assert attempt["latency_ms"] >= 0
    assert listed["delivered_at"] is not None
    [one, two] = receiver.received()
    assert one.webhook_id == two.webhook_id == listed["webhook_id"]
    assert one.body == two.body


def test_another_tenants_deliveries_are_404(
    client: TestClient,
    make_tenant: Callable[..., TenantHandle],
    delivered: tuple[dict[str, Any], Received],
    tenant: TenantHandle,
) -> None:
    task, _ = delivered
    [listed] = deliveries(client, tenant, task["id"])
    other = make_tenant()

    listing = client.get(f"/v1/tasks/{task['id']}/webhook-deliveries", headers=other.headers)
    redelivery = client.post(
        f"/v1/webhook-deliveries/{listed['id']}/redeliver", headers=other.headers
    )

    assert_problem(listing, 404)
    assert_problem(redelivery, 404)
    assert deliveries(client, tenant, task["id"])[0]["status"] == "delivered"


def test_events_and_their_deliveries_commit_together(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], receiver: WebhookReceiver
) -> None:
    task = submit(client, tenant, webhook={"url": receiver.url(), "events": EVERY_EVENT})
    drive(task["id"])

    with transaction() as session:
        events = session.scalars(
            select(TaskEvent).where(TaskEvent.task_id == task["id"]).order_by(TaskEvent.seq)
        ).all()
        wanted = [(e.seq, e.type) for e in events if e.type in EVERY_EVENT]
    queued = [(r.event_seq, r.event_type) for r in delivery_rows(task["id"])]
    assert queued == wanted
