"""Event wake-ups on real Redis: a commit hands its wake-up to the process's publisher and
goes on; every task named reaches a subscriber, from many threads at once, and a Redis that
is down loses wake-ups (readers poll) without raising into the step."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import redis

from shared import notify
from shared.settings import get_settings
from shared.transport.redis import PIPELINE_WINDOW_SECONDS, PIPELINES_PER_WINDOW, Publisher

WAIT = 30.0  # a bound for the test to fail rather than hang


def _subscribed(url: str, pattern: str) -> redis.client.PubSub:
    """A subscription to ``pattern``, in place before this returns."""
    pubsub = redis.Redis.from_url(url).pubsub()
    pubsub.psubscribe(pattern)
    confirmed = pubsub.get_message(timeout=5)
    assert confirmed is not None
    assert confirmed["type"] == "psubscribe", confirmed
    return pubsub


def test_every_task_named_from_many_threads_is_woken(service_env: dict[str, str]) -> None:
    prefix = f"wake-{time.monotonic_ns()}-"
    pubsub = _subscribed(get_settings().redis_url, notify.channel(prefix) + "*")
    names = [f"{prefix}{n}" for n in range(400)]

    def commit(part: list[str]) -> None:
        for task_id in part:
            notify.publish([task_id])

    threads = [threading.Thread(target=commit, args=(names[i::8],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)

    woken: set[str] = set()
    deadline = time.monotonic() + WAIT
    while woken != set(names) and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=1)
        if message is not None:
            woken.add(message["channel"].decode().removeprefix(notify.channel("")))
    pubsub.close()
    assert woken == set(names)


def test_a_redis_that_is_down_loses_wake_ups_without_raising() -> None:
    publisher = Publisher(redis.Redis.from_url("redis://127.0.0.1:1/0"))
    started = time.monotonic()
    for n in range(50):
        publisher.put(notify.channel(f"nobody-{n}"))  # handed over: the caller never waits
    publisher.send([notify.channel("nobody")])  # what its thread does: logged, not raised
    assert time.monotonic() - started < WAIT


def test_a_submissions_dispatcher_wake_up_reaches_the_dispatcher(
    service_env: dict[str, str],
) -> None:
    """Sent from the wake-up thread, as the event wake-ups are: a Waiter sees it."""
    from shared.scheduling import wake

    waiter = wake.Waiter()
    assert not waiter.wait(0.01)  # subscribed, and nothing sent yet
    wake.wake()
    assert waiter.wait(WAIT)


class _Recording(Publisher):
    """A publisher that notes when each of its pipelines starts, and what it carries."""

    def __init__(self, client: redis.Redis) -> None:
        self.sent: list[tuple[float, int]] = []
        super().__init__(client)

    def send(self, channel_names: Iterable[str]) -> None:
        names = list(channel_names)
        self.sent.append((time.monotonic(), len(names)))
        super().send(names)


def test_a_stream_of_wake_ups_gathers_into_pipelines_a_window_apart(
    service_env: dict[str, str],
) -> None:
    prefix = f"burst-{time.monotonic_ns()}-"
    url = get_settings().redis_url
    pubsub = _subscribed(url, notify.channel(prefix) + "*")
    publisher = _Recording(redis.Redis.from_url(url))
    names = [notify.channel(f"{prefix}{n}") for n in range(300)]
    quick = names[:PIPELINES_PER_WINDOW]
    for name in quick:  # the publisher is idle: each goes out at once
        publisher.put(name)
        while len(publisher.sent) < quick.index(name) + 1:
            time.sleep(0.0005)
    for name in names[len(quick) :]:  # the window's pipelines went out: these gather
        publisher.put(name)

    woken: set[str] = set()
    deadline = time.monotonic() + WAIT
    while len(woken) < len(names) and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=1)
        if message is not None:
            woken.add(message["channel"].decode())
    pubsub.close()

    assert woken == set(names)  # nothing lost
    starts = [at for at, _ in publisher.sent]
    assert sum(count for _, count in publisher.sent) == len(names)  # nothing twice
    assert [count for _, count in publisher.sent[: len(quick)]] == [1] * len(quick)  # at once
    assert len(quick) < len(starts) < len(names)  # the rest gathered
    # No window holds more than its pipelines.
    spans = [b - a for a, b in zip(starts, starts[PIPELINES_PER_WINDOW:], strict=False)]
    assert all(span >= PIPELINE_WINDOW_SECONDS * 0.99 for span in spans), spans
