"""The sweeper against the real Postgres and the real Redis broker: a lost message is sent
again, a message that is only waiting behind a backlog is not.

PostgreSQL and Redis only: each test looks into the Redis broker's queues, and the in-process
queue of SQLite runs offers no such look (there the sweeper goes by the clock alone, which
``test_durability`` covers on both backends)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import select

from shared.queue import webhook_queue
from shared.settings import get_settings
from shared.store.db import transaction
from shared.store.outbox import DeliveryStatus
from shared.store.tables import Task, WebhookDelivery
from tests.conftest import REDIS_URL, Configure, TenantHandle
from tests.fakes.receiver import WebhookReceiver
from tests.helpers import admit, calculator_script, scripted_task
from workers import sweeper, webhook_sender

GRACE_S = 1.0


@pytest.fixture
def queues(service_env: dict[str, str], configure: Configure) -> Iterator[redis.Redis]:
    """Queues of this test's own, a one-second grace, and no other sweeper's lock in the way."""
    name = f"ratchet-sweep-{uuid.uuid4().hex[:8]}"
    configure(RATCHET_QUEUE_NAME=name, RATCHET_SWEEP_GRACE_SECONDS=str(GRACE_S))
    broker = redis.Redis.from_url(REDIS_URL)
    yield broker
    broker.delete(name, webhook_queue(get_settings()))


def submit(client: TestClient, tenant: TenantHandle, **extra: Any) -> str:
    body = scripted_task(calculator_script(2), **extra)
    response = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert response.status_code == 202, response.text
    assert admit() == 1  # as the dispatcher does: admitted, its message sent
    return str(response.json()["id"])


def waiting(broker: redis.Redis, queue: str) -> list[str]:
    """The task ids of the messages waiting in ``queue``, oldest first."""
    raw = cast(list[bytes], broker.lrange(queue, 0, -1))
    messages = [json.loads(m) for m in reversed(raw)]
    return [str(m["headers"]["argsrepr"]).split("'")[1] for m in messages]


def due_ms(task_id: str) -> int:
    with transaction() as session:
        due = session.scalar(select(Task.due_ms).where(Task.id == task_id))
    assert due is not None
    return int(due)


def test_tasks_waiting_behind_a_backlog_get_no_second_message(
    client: TestClient, tenant: TenantHandle, queues: redis.Redis
) -> None:
    queue = get_settings().queue_name
    tasks = [submit(client, tenant) for _ in range(3)]
    assert waiting(queues, queue) == tasks
    time.sleep(GRACE_S + 0.2)  # each is overdue by the clock alone: nobody took its message
    assert sweeper.sweep_once() == 0
    assert waiting(queues, queue) == tasks

    queues.delete(queue)  # Redis lost them (a flush, a restart without persistence)
    before = [due_ms(t) for t in tasks]
    assert sweeper.sweep_once() == 3
    assert sorted(waiting(queues, queue)) == sorted(tasks)
    assert all(due_ms(t) > due for t, due in zip(tasks, before, strict=True))
    assert sweeper.sweep_once() == 0  # each got its one message


def test_a_lone_lost_message_is_sent_again_once_the_queue_has_moved_past_it(
    client: TestClient, tenant: TenantHandle, queues: redis.Redis
) -> None:
    queue = get_settings().queue_name
    lost = submit(client, tenant)
    time.sleep(max(GRACE_S, sweeper.SEND_ORDER_MARGIN_MS / 1000) + 0.3)
    later = submit(client, tenant)
    queues.rpop(queue)  # the next message a worker would take: as if it vanished on the way
    assert waiting(queues, queue) == [later]
    assert sweeper.sweep_once() == 1
    assert waiting(queues, queue) == [later, lost]


@pytest.fixture
def pending_delivery(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
    queues: redis.Redis,
) -> Iterator[str]:
    """A task's ``task.succeeded`` delivery, committed but never handed to a sender."""
    held: list[str] = []
    monkeypatch.setattr(webhook_sender, "dispatch", held.extend)
    with WebhookReceiver() as receiver:
        task_id = submit(client, tenant, webhook={"url": receiver.url()})
        queues.delete(get_settings().queue_name)  # this test drives the task itself
        assert drive(task_id) == "succeeded"
        with transaction() as session:
            rows = session.scalars(
                select(WebhookDelivery).where(WebhookDelivery.task_id == task_id)
            ).all()
            assert [r.status for r in rows] == [DeliveryStatus.PENDING]
            yield rows[0].id


def test_a_delivery_gets_a_new_message_once_a_grace_and_not_while_one_waits(
    pending_delivery: str, queues: redis.Redis
) -> None:
    queue = webhook_queue(get_settings())
    assert sweeper.sweep_once() == 0  # committed just now: its own sender may still be on it
    time.sleep(GRACE_S + 0.2)
    assert sweeper.sweep_once() == 1  # that sender died: a message for another worker
    assert queues.llen(queue) == 1
    time.sleep(GRACE_S + 0.2)
    assert sweeper.sweep_once() == 0  # its message is still waiting: the workers are busy
    assert queues.llen(queue) == 1

    queues.delete(queue)  # and now it is lost
    assert sweeper.sweep_once() == 1
    assert queues.llen(queue) == 1


def test_a_queue_that_cannot_be_read_never_stops_the_sweeping(
    queues: redis.Redis, configure: Configure
) -> None:
    from shared.queue import SENT_AT_HEADER, oldest_waiting_ms

    queue = get_settings().queue_name
    queues.lpush(queue, json.dumps({"headers": {SENT_AT_HEADER: 1}}))
    assert oldest_waiting_ms(queue) is None  # waiting since 1970: nobody takes from it
    queues.delete(queue)
    queues.lpush(queue, b"not json")
    assert oldest_waiting_ms(queue) is None
    configure(RATCHET_BROKER_URL=f"{REDIS_URL}?no_such_option=1")
    assert oldest_waiting_ms(queue) is None  # redis-py refuses the URL: a TypeError
    assert sweeper.sweep_once() == 0
