"""How long to wait before trying again.

A failed model call waits with exponential backoff and full jitter (capped), or longer if the
provider's Retry-After says so; a wait too long to sleep through in a worker goes back on
the queue. A webhook delivery waits as ``RATCHET_WEBHOOK_RETRY_SCHEDULE`` says, ±20%, and
fails once the schedule is spent.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tenacity import RetryCallState, Retrying

from shared.errors import ModelRateLimited, ModelTransientError
from shared.settings import get_settings
from shared.store.tables import WebhookDelivery
from shared.webhooks.deliveries import next_delay_seconds
from workers.model_calls import MAX_BACKOFF_SECONDS, Deferred, RetryPolicy

BASE = 0.5
MAX_ATTEMPTS = 5


@pytest.fixture
def retry_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Backoff from 0.5 s, five attempts, no wait slept in the worker; the default webhook
    schedule."""
    monkeypatch.delenv("RATCHET_WEBHOOK_RETRY_SCHEDULE", raising=False)
    monkeypatch.setenv("RATCHET_MODEL_RETRY_BASE_SECONDS", str(BASE))
    monkeypatch.setenv("RATCHET_MODEL_MAX_ATTEMPTS", str(MAX_ATTEMPTS))
    monkeypatch.setenv("RATCHET_MODEL_RETRY_INLINE_MAX_SECONDS", "0")
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.fixture
def jitter(monkeypatch: pytest.MonkeyPatch, retry_settings: None) -> list[tuple[float, float]]:
    """The jitter's range for each wait; it draws the top of the range, the longest wait."""
    ranges: list[tuple[float, float]] = []

    def uniform(low: float, high: float) -> float:
        ranges.append((low, high))
        return high

    monkeypatch.setattr(random, "uniform", uniform)
    return ranges


def failed(number: int, exc: Exception | None = None) -> RetryCallState:
    """The state after the ``number``-th attempt of this message failed with ``exc``."""
    state = RetryCallState(Retrying(), fn=None, args=(), kwargs={})
    state.attempt_number = number
    exc = exc or ModelTransientError("the model provider answered 503")
    state.set_exception((type(exc), exc, None))
    return state


# --- model calls ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prior", "attempt", "ceiling"),
    [
        (0, 1, BASE),
        (0, 2, 2 * BASE),
        (0, 3, 4 * BASE),
        (2, 1, 4 * BASE),  # a step re-queued after two failures keeps its place
        (0, 11, 1024 * BASE),  # 512 s: still under the cap
        (0, 12, MAX_BACKOFF_SECONDS),  # 2048 × 0.5 s would be 1024 s: capped
        (0, 60, MAX_BACKOFF_SECONDS),
    ],
)
def test_backoff_is_full_jitter_up_to_a_ceiling_that_doubles_and_is_capped(
    jitter: list[tuple[float, float]], prior: int, attempt: int, ceiling: float
) -> None:
    wait = RetryPolicy(prior=prior).wait(failed(attempt))
    assert jitter == [(0, ceiling)]
    assert wait == ceiling


@pytest.mark.usefixtures("jitter")
def test_the_longest_wait_never_shrinks_and_never_passes_the_cap() -> None:
    policy = RetryPolicy(prior=0)
    waits = [policy.wait(failed(n)) for n in range(1, 80)]
    assert waits == sorted(waits)
    assert max(waits) == MAX_BACKOFF_SECONDS


@pytest.mark.usefixtures("retry_settings")
@pytest.mark.parametrize(("drawn", "retry_after", "wait"), [(0.0, 42.0, 42.0), (9.0, 3.0, 9.0)])
def test_a_429_waits_at_least_its_retry_after(
    monkeypatch: pytest.MonkeyPatch, drawn: float, retry_after: float, wait: float
) -> None:
    monkeypatch.setattr(random, "uniform", lambda low, high: drawn)
    limited = ModelRateLimited("the model provider answered 429", retry_after=retry_after)
    assert RetryPolicy(prior=0).wait(failed(4, limited)) == wait


@pytest.mark.usefixtures("jitter")
def test_the_failures_counted_include_those_of_earlier_messages() -> None:
    policy = RetryPolicy(prior=2)
    policy.wait(failed(2))
    assert policy.failures == 4


@pytest.mark.usefixtures("retry_settings")
@pytest.mark.parametrize(
    ("prior", "attempt", "stop"),
    [(0, MAX_ATTEMPTS - 1, False), (0, MAX_ATTEMPTS, True), (3, 1, False), (3, 2, True)],
)
def test_retries_stop_once_the_step_made_max_attempts_calls_across_its_messages(
    prior: int, attempt: int, stop: bool
) -> None:
    assert RetryPolicy(prior=prior).stop(failed(attempt)) is stop


@pytest.mark.usefixtures("retry_settings")
def test_a_wait_longer_than_the_worker_may_sleep_goes_back_on_the_queue() -> None:
    policy = RetryPolicy(prior=1)
    policy.failures = 3
    with pytest.raises(Deferred) as deferred:
        policy.sleep(0.001)
    assert deferred.value.delay_s == 0.001
    assert deferred.value.failures == 3  # persisted, so the next message keeps counting
    assert deferred.value.reason == {"reason": "retry_backoff"}


@pytest.mark.usefixtures("retry_settings")
def test_a_wait_up_to_the_inline_maximum_is_slept_in_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RATCHET_MODEL_RETRY_INLINE_MAX_SECONDS", "1.5")
    get_settings.cache_clear()
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    policy = RetryPolicy(prior=0)

    policy.sleep(1.5)  # the maximum itself
    with pytest.raises(Deferred):
        policy.sleep(1.501)
    assert slept == [1.5]


# --- webhook deliveries --------------------------------------------------------------------------

SCHEDULE = [0.0, 5.0, 300.0, 1800.0]


def delivery(*, attempts: int, attempts_base: int = 0) -> Any:
    return WebhookDelivery(attempts=attempts, attempts_base=attempts_base)


@given(
    schedule=st.lists(st.floats(0, 10**6), min_size=1, max_size=10),
    attempts=st.integers(1, 12),
)
def test_after_the_ith_attempt_a_delivery_waits_the_ith_entry_give_or_take_a_fifth(
    schedule: list[float], attempts: int
) -> None:
    delay = next_delay_seconds(delivery(attempts=attempts), schedule)
    if attempts >= len(schedule):
        assert delay is None  # spent: the delivery fails
    else:
        assert delay is not None
        assert 0.8 * schedule[attempts] <= delay <= 1.2 * schedule[attempts]


@pytest.mark.usefixtures("retry_settings")
def test_the_default_schedule_retries_after_5_s_then_5_min_and_gives_up_when_spent() -> None:
    schedule = get_settings().webhook_retry_schedule
    second = next_delay_seconds(delivery(attempts=1), schedule)
    third = next_delay_seconds(delivery(attempts=2), schedule)
    assert second is not None
    assert third is not None
    assert 4.0 <= second <= 6.0
    assert 240.0 <= third <= 360.0
    assert next_delay_seconds(delivery(attempts=len(schedule)), schedule) is None


def test_a_redelivery_starts_the_schedule_over() -> None:
    spent = delivery(attempts=len(SCHEDULE))
    assert next_delay_seconds(spent, SCHEDULE) is None
    redelivered = delivery(attempts=len(SCHEDULE) + 1, attempts_base=len(SCHEDULE))
    delay = next_delay_seconds(redelivered, SCHEDULE)
    assert delay is not None
    assert 4.0 <= delay <= 6.0
