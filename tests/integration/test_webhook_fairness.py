"""Webhook sending is fair between tenants and receivers: one tenant's hanging receivers never
hold back another tenant's webhooks, an attempt ends within its deadline however its receiver
dawdles, a broker message holds no worker while its delivery is sent, an endpoint that keeps
failing has its circuit opened (and closed again by a probe), and a tenant's endpoints are
capped.

Receivers are real HTTP servers on 127.0.0.1 (``tests/fakes/receiver.py``), some of which
accept a request and never answer it, or drip an answer that never ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update

from shared.store.db import now_ms, transaction
from shared.store.outbox import DeliveryStatus
from shared.store.tables import WebhookDelivery, WebhookEndpoint
from shared.webhooks import circuits, endpoints
from tests.conftest import Configure, TenantHandle
from tests.fakes.receiver import WebhookReceiver
from tests.helpers import scripted_task
from workers import webhook_sender

PATH = "/v1/webhook-endpoints"
DONE = ["task.succeeded"]


@pytest.fixture
def held_back(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Deliveries committed from now on stay pending until the test sends them."""
    held: list[str] = []
    monkeypatch.setattr(webhook_sender, "dispatch", held.extend)
    return held


def add_endpoint(tenant: TenantHandle, url: str) -> str:
    with transaction() as session:
        return endpoints.create(session, tenant.id, url=url, events=DONE).id


def finish_task(client: TestClient, tenant: TenantHandle, drive: Callable[..., str]) -> str:
    response = client.post(
        "/v1/tasks", json=scripted_task([{"content": "done"}]), headers=tenant.headers
    )
    assert response.status_code == 202, response.text
    task_id: str = response.json()["id"]
    assert drive(task_id) == "succeeded"
    return task_id


def delivery_of(task_id: str) -> WebhookDelivery:
    with transaction() as session:
        [row] = session.scalars(
            select(WebhookDelivery).where(WebhookDelivery.task_id == task_id)
        ).all()
        session.expunge_all()
    return row


def make_due(delivery_id: str) -> None:
    with transaction() as session:
        session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == delivery_id)
            .values(next_attempt_ms=0)
        )


def circuit_of(client: TestClient, tenant: TenantHandle, endpoint_id: str) -> dict[str, Any]:
    response = client.get(f"{PATH}/{endpoint_id}", headers=tenant.headers)
    assert response.status_code == 200, response.text
    circuit: dict[str, Any] = response.json()["circuit"]
    return circuit


def end_the_cooldown(endpoint_id: str) -> None:
    """End the endpoint's open circuit's cooldown now, on the database's clock: the test's
    cooldown is long (a loaded machine must not see it run out between two of its steps),
    and what it checks is what happens once it is over, not how long it lasts."""
    with transaction() as session:
        session.execute(
            update(WebhookEndpoint)
            .where(WebhookEndpoint.id == endpoint_id, WebhookEndpoint.circuit_until_ms.is_not(None))
            .values(circuit_until_ms=now_ms() - 1)
        )


# --- fairness -------------------------------------------------------------------------------------


def test_a_tenants_hanging_receivers_do_not_hold_back_another_tenants_webhook(
    client: TestClient,
    drive: Callable[..., str],
    make_tenant: Callable[..., TenantHandle],
) -> None:
    """Tenant A has 30 endpoints on three receivers that take requests and never answer (one
    silent, two dripping an endless answer); tenant B has one on a prompt receiver. With A's
    webhooks hanging, B's arrives well within 15 s (it used to wait behind all of A's)."""
    noisy, quiet = make_tenant(), make_tenant()
    with ExitStack() as stack:
        hanging = [stack.enter_context(WebhookReceiver()) for _ in range(3)]
        for receiver, drip in zip(hanging, (None, 0.5, 0.5), strict=True):
            receiver.hang("/hooks", drip=drip)
            for _ in range(10):
                add_endpoint(noisy, receiver.url("/hooks"))
        prompt = stack.enter_context(WebhookReceiver())
        add_endpoint(quiet, prompt.url("/hooks"))

        finish_task(client, noisy, drive)
        hanging[0].wait_for(1, timeout=15)  # A's sends are under way, and hang
        quiet_task = finish_task(client, quiet, drive)

        [arrived] = prompt.wait_for(1, timeout=15)
        assert arrived.json()["data"]["id"] == quiet_task
        assert sum(len(r.received()) for r in hanging) < 30  # A's still hang or wait
    # The receivers are closed: A's sends end at once. Let them, before the tenants go.
    webhook_sender.wait_for_sends()


def test_an_attempt_ends_within_its_deadline_however_slowly_the_receiver_drips(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    held_back: list[str],
    configure: Configure,
) -> None:
    """The receiver sends a byte of its answer every 0.2 s, forever: each read is quick, but
    the attempt as a whole is cut off at RATCHET_WEBHOOK_TIMEOUT_SECONDS (1 s here)."""
    configure(RATCHET_WEBHOOK_TIMEOUT_SECONDS="1")
    with WebhookReceiver() as receiver:
        receiver.hang("/drip", drip=0.2)
        add_endpoint(tenant, receiver.url("/drip"))
        delivery = delivery_of(finish_task(client, tenant, drive))
        outcome: list[str | None] = []
        sending = threading.Thread(
            target=lambda: outcome.append(webhook_sender.attempt(delivery.id)), daemon=True
        )
        started = time.monotonic()
        sending.start()
        sending.join(timeout=15)
        took = time.monotonic() - started

    assert not sending.is_alive(), "the attempt was still reading the dripping answer"
    assert outcome == [DeliveryStatus.PENDING]  # a failed attempt, to be retried
    assert took < 10, took
    failed = delivery_of(delivery.task_id)
    assert failed.last_error is not None
    assert "Timeout" in failed.last_error, failed.last_error


def test_a_broker_message_for_a_delivery_holds_no_worker_while_it_is_sent(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    held_back: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The message's task hands the delivery to the process's sender and returns at once,
    though the receiver never answers; the delivery is still sent (it arrives)."""
    with WebhookReceiver() as receiver:
        receiver.hang("/silent")
        add_endpoint(tenant, receiver.url("/silent"))
        delivery = delivery_of(finish_task(client, tenant, drive))
        monkeypatch.undo()  # the sender takes hand-offs again
        started = time.monotonic()
        webhook_sender.deliver(delivery.id)
        took = time.monotonic() - started
        receiver.wait_for(1, timeout=15)
    webhook_sender.wait_for_sends()  # the receiver is closed: the send ends at once

    assert took < 5, took  # the receiver would hold it 10 s (RATCHET_WEBHOOK_TIMEOUT_SECONDS)


# --- the circuit breaker --------------------------------------------------------------------------


def test_an_endpoints_circuit_opens_after_failures_in_a_row_and_a_probe_closes_it(
    client: TestClient,
    make_tenant: Callable[..., TenantHandle],
    drive: Callable[..., str],
    held_back: list[str],
    configure: Configure,
) -> None:
    admin = make_tenant(("admin", "tasks:read", "tasks:write"))
    configure(RATCHET_WEBHOOK_BREAKER_FAILURES="3", RATCHET_WEBHOOK_BREAKER_COOLDOWN_SECONDS="600")
    with WebhookReceiver() as receiver:
        receiver.respond("/down", then=503)
        endpoint_id = add_endpoint(admin, receiver.url("/down"))
        rows = [delivery_of(finish_task(client, admin, drive)) for _ in range(4)]
        assert [webhook_sender.attempt(r.id) for r in rows[:3]] == [DeliveryStatus.PENDING] * 3

        opened = circuit_of(client, admin, endpoint_id)
        assert (opened["state"], opened["consecutive_failures"]) == ("open", 3)
        assert opened["until"] is not None
        # Open: the fourth is put off without a request, on its schedule, past the cooldown.
        assert webhook_sender.attempt(rows[3].id) == DeliveryStatus.PENDING
        assert len(receiver.received("/down")) == 3
        held = delivery_of(rows[3].task_id)
        assert held.last_error is not None
        assert "circuit is open" in held.last_error
        assert held.next_attempt_ms is not None

        # Half-open: one probe goes; it fails, and the circuit opens again for longer.
        end_the_cooldown(endpoint_id)
        make_due(rows[0].id)
        assert webhook_sender.attempt(rows[0].id) == DeliveryStatus.PENDING
        assert len(receiver.received("/down")) == 4
        assert circuit_of(client, admin, endpoint_id)["state"] == "open"

        # The next probe succeeds: the circuit closes and the count starts again.
        receiver.respond("/down", then=200)
        end_the_cooldown(endpoint_id)
        make_due(rows[3].id)
        assert webhook_sender.attempt(rows[3].id) == DeliveryStatus.DELIVERED
        closed = circuit_of(client, admin, endpoint_id)
        assert closed == {"state": "closed", "consecutive_failures": 0, "until": None}


def test_once_the_cooldown_is_over_one_caller_probes_and_the_others_wait(
    make_tenant: Callable[..., TenantHandle], configure: Configure
) -> None:
    tenant = make_tenant()
    endpoint_id = add_endpoint(tenant, "https://localhost/hooks")
    configure(RATCHET_WEBHOOK_BREAKER_FAILURES="2")
    for _ in range(2):
        with transaction() as session:
            circuits.record(session, endpoint_id, succeeded=False)
    with transaction() as session:
        session.execute(
            update(WebhookEndpoint)
            .where(WebhookEndpoint.id == endpoint_id)
            .values(circuit_until_ms=0)  # the cooldown is over
        )
    with transaction() as session:
        first = circuits.admit(session, endpoint_id, probe_ms=60_000)
    with transaction() as session:
        second = circuits.admit(session, endpoint_id, probe_ms=60_000)

    assert first is None  # the probe
    assert second is not None  # waits for the probe's outcome
    with transaction() as session:
        endpoint = session.get(WebhookEndpoint, endpoint_id)
        assert endpoint is not None
        assert endpoint.circuit_state == circuits.CircuitState.HALF_OPEN


# --- the cap on endpoints -------------------------------------------------------------------------


@pytest.mark.backends("postgresql", "sqlite")
def test_a_tenant_past_its_most_endpoints_gets_a_409_and_nothing_is_added(
    client: TestClient, make_tenant: Callable[..., TenantHandle], configure: Configure
) -> None:
    admin, other = make_tenant(("admin",)), make_tenant(("admin",))
    body = {"url": "https://localhost/hooks"}
    configure(RATCHET_MAX_WEBHOOK_ENDPOINTS_PER_TENANT="3")
    made = [client.post(PATH, json=body, headers=admin.headers) for _ in range(3)]
    refused = client.post(PATH, json=body, headers=admin.headers)
    elsewhere = client.post(PATH, json=body, headers=other.headers)
    client.delete(f"{PATH}/{made[0].json()['id']}", headers=admin.headers)
    again = client.post(PATH, json=body, headers=admin.headers)

    assert [r.status_code for r in made] == [201] * 3
    assert refused.status_code == 409, refused.text
    assert refused.headers["content-type"].startswith("application/problem+json")
    assert "RATCHET_MAX_WEBHOOK_ENDPOINTS_PER_TENANT" in refused.json()["detail"]
    assert (elsewhere.status_code, again.status_code) == (201, 201)
    with transaction() as session:
        held = session.scalar(
            select(func.count())
            .select_from(WebhookEndpoint)
            .where(WebhookEndpoint.tenant_id == admin.id)
        )
    assert held == 3
