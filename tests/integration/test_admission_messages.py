"""An admission round's messages on the real broker: several steps to a message, spread
over several messages, each step once and in order; a worker process hands a message's
steps to its pool, and those its full pool cannot take go back on the queue."""

from __future__ import annotations

import ast
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any, cast

import pytest
import redis

from shared.constants import ADVANCE_TASK, ADVANCE_TASKS
from shared.queue import STEPS_PER_MESSAGE, enqueue_steps
from shared.settings import get_settings
from tests.conftest import REDIS_URL, Configure
from workers import app as worker_app
from workers import step_pool
from workers.step_pool import StepPool

WAIT = 30.0  # a bound for the test to fail rather than hang


@pytest.fixture
def queue(service_env: dict[str, str], configure: Configure) -> Iterator[redis.Redis]:
    name = f"ratchet-admit-{uuid.uuid4().hex[:8]}"
    configure(RATCHET_QUEUE_NAME=name)
    broker = redis.Redis.from_url(REDIS_URL)
    yield broker
    broker.delete(name)


def sent(broker: redis.Redis) -> list[tuple[str, list[Any]]]:
    """Each waiting message's task name and arguments, oldest first."""
    raw = cast(list[bytes], broker.lrange(get_settings().queue_name, 0, -1))
    messages = [json.loads(m) for m in reversed(raw)]
    return [(m["headers"]["task"], m["headers"]["argsrepr"]) for m in messages]


def steps_of(broker: redis.Redis) -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []
    for name, argsrepr in sent(broker):
        args = ast.literal_eval(argsrepr)
        if name == ADVANCE_TASK:
            found.append((args[0], args[1]))
        else:
            assert name == ADVANCE_TASKS
            found += [(task_id, step) for task_id, step in args[0]]
    return found


@pytest.mark.parametrize("count", [1, 3, 8, 9, 40, 101])
def test_a_rounds_steps_go_each_once_in_order_several_to_a_message(
    queue: redis.Redis, count: int
) -> None:
    steps = [(f"task-{n}", 1 + n % 3) for n in range(count)]
    assert enqueue_steps(steps)

    assert steps_of(queue) == steps
    messages = sent(queue)
    assert len(messages) >= min(count, 4)  # spread over processes while there are enough
    assert len(messages) <= -(-count // STEPS_PER_MESSAGE) + 4
    if count < 8:
        assert all(name == ADVANCE_TASK for name, _ in messages)  # one step to a message


def test_a_message_gives_back_the_steps_a_full_pool_cannot_take(
    queue: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, ran = threading.Event(), []
    pool = StepPool(2)
    monkeypatch.setattr(step_pool, "get_pool", lambda: pool)

    def advance(task_id: str, step: int, **_: Any) -> None:
        ran.append((task_id, step))
        release.wait(WAIT)

    monkeypatch.setattr(worker_app.runner, "advance", advance)
    pairs = [[f"task-{n}", 1] for n in range(5)]
    worker_app.advance_tasks.run(pairs)  # as a worker process runs the message

    assert steps_of(queue) == [(f"task-{n}", 1) for n in range(2, 5)]  # back on the queue
    release.set()
    assert pool.drain(WAIT) == 0
    assert sorted(ran) == [("task-0", 1), ("task-1", 1)]
