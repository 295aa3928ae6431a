"""A model call: its retries, how long it waits before trying again, and the lease it must hold.

The first attempt runs outside tenacity and a transient failure is handed over to it, so the
attempts, the failures recorded and the count in the error are those of one retry loop. A
failed call waits with exponential backoff and full jitter (capped), or longer if the
provider's Retry-After says so; a wait too long to sleep through in a worker goes back on the
queue. A stalled worker asks no model for a lease it may have lost.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from tenacity import RetryCallState, Retrying

from shared.errors import (
    LeaseLost,
    ModelError,
    ModelPermanentError,
    ModelRateLimited,
    ModelTransientError,
)
from shared.ratelimit.in_process import LocalLimiter
from tests.conftest import Configure
from workers import model_calls
from workers.model_calls import MAX_BACKOFF_SECONDS, Deferred, RetryPolicy
from workers.providers import ModelRequest, ModelResponse


class Flaky:
    """Fails transiently ``failures`` times, then answers (or fails for good, if told)."""

    def __init__(self, failures: int, *, then: ModelError | None = None) -> None:
        self.failures, self.then, self.calls = failures, then, 0

    def complete(self, request: ModelRequest) -> ModelResponse:
        self.calls += 1
        if self.calls <= self.failures:
            raise ModelTransientError(f"timeout {self.calls}")
        if self.then is not None:
            raise self.then
        return ModelResponse(content="done", tool_calls=[], input_tokens=3, output_tokens=1)


@pytest.fixture
def quick_retries(configure: Configure, monkeypatch: pytest.MonkeyPatch) -> None:
    configure(RATCHET_MODEL_MAX_ATTEMPTS="3", RATCHET_MODEL_RETRY_BASE_SECONDS="0")
    monkeypatch.setattr(model_calls, "get_limiter", LocalLimiter)


def request() -> ModelRequest:
    messages = [{"role": "user", "content": "hi"}]
    return ModelRequest(task_id="t", step=1, model="m", messages=messages, tools=[], options={})


def complete(provider: Flaky, *, prior: int = 0, failed: list[dict[str, object]]) -> ModelResponse:
    return model_calls.complete(
        provider,  # type: ignore[arg-type]
        request(),
        model="test:m",
        tenant="t",
        prior_failures=prior,
        failed=failed,
    )


@pytest.mark.usefixtures("quick_retries")
@pytest.mark.parametrize("failures", [0, 1, 2])
def test_transient_failures_are_retried_up_to_the_attempts(failures: int) -> None:
    provider, failed = Flaky(failures), []
    assert complete(provider, failed=failed).content == "done"
    assert provider.calls == failures + 1
    assert [f["error"]["message"] for f in failed] == [  # type: ignore[index]
        f"timeout {n}" for n in range(1, failures + 1)
    ]


@pytest.mark.usefixtures("quick_retries")
@pytest.mark.parametrize(("prior", "calls"), [(0, 3), (1, 2), (2, 1)])
def test_the_attempts_run_out_counting_the_steps_earlier_failures(prior: int, calls: int) -> None:
    provider, failed = Flaky(10), []
    with pytest.raises(ModelTransientError, match=r"\(after 3 attempts\)"):
        complete(provider, prior=prior, failed=failed)
    assert provider.calls == calls
    assert len(failed) == calls


@pytest.mark.usefixtures("quick_retries")
@pytest.mark.parametrize("failures", [0, 1])
def test_a_permanent_error_is_not_retried(failures: int) -> None:
    provider, failed = Flaky(failures, then=ModelPermanentError("bad request")), []
    with pytest.raises(ModelPermanentError, match=rf"bad request \(after {failures + 1} attempts"):
        complete(provider, failed=failed)
    assert provider.calls == failures + 1


class CountingProvider:
    def __init__(self) -> None:
        self.calls = 0

    def complete(self, request: ModelRequest) -> ModelResponse:
        self.calls += 1
        return ModelResponse(content="ok", tool_calls=[], input_tokens=1, output_tokens=1)


def test_no_model_is_asked_for_a_lease_that_may_be_lost() -> None:
    provider = CountingProvider()
    asked_on: list[str] = []

    def lost() -> bool:
        asked_on.append(threading.current_thread().name)
        return False

    with pytest.raises(LeaseLost):
        model_calls.limited_call(
            provider, request(), model="scripted:m", tenant="t", still_held=lost
        )
    assert provider.calls == 0
    # Asked last thing before the request would go out, on the thread that would send it: a
    # step that waited for a thread of the pool (or for capacity) is asked after the wait.
    [thread] = asked_on
    assert thread.startswith("model-call"), thread
    answer = model_calls.limited_call(provider, request(), model="scripted:m", tenant="t")
    assert (answer.content, provider.calls) == ("ok", 1)


BASE = 0.5
MAX_ATTEMPTS = 5


@pytest.fixture
def retry_settings(configure: Configure) -> None:
    """Backoff from 0.5 s, five attempts, no wait slept in the worker; the default webhook
    schedule."""
    configure(
        RATCHET_WEBHOOK_RETRY_SCHEDULE=None,
        RATCHET_MODEL_RETRY_BASE_SECONDS=str(BASE),
        RATCHET_MODEL_MAX_ATTEMPTS=str(MAX_ATTEMPTS),
        RATCHET_MODEL_RETRY_INLINE_MAX_SECONDS="0",
    )


@pytest.fixture
def jitter(monkeypatch: pytest.MonkeyPatch, retry_settings: None) -> list[tuple[float, float]]:
    """The jitter's range for each wait; it draws the top of the range, the longest wait."""
    ranges: list[tuple[float, float]] = []

    def uniform(low: float, high: float) -> float:
        ranges.append((low, high))
        return high

    monkeypatch.setattr(random, "uniform", uniform)
    return ranges


def failed_attempt(number: int, exc: Exception | None = None) -> RetryCallState:
    """The state after the ``number``-th attempt of this message failed with ``exc``."""
    state = RetryCallState(Retrying(), fn=None, args=(), kwargs={})
    state.attempt_number = number
    exc = exc or ModelTransientError("the model provider answered 503")
    state.set_exception((type(exc), exc, None))
    return state


# --- how long a failed call waits ------------------------------------------------------------


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
    wait = RetryPolicy(prior=prior).wait(failed_attempt(attempt))
    assert jitter == [(0, ceiling)]
    assert wait == ceiling


@pytest.mark.usefixtures("jitter")
def test_the_longest_wait_never_shrinks_and_never_passes_the_cap() -> None:
    policy = RetryPolicy(prior=0)
    waits = [policy.wait(failed_attempt(n)) for n in range(1, 80)]
    assert waits == sorted(waits)
    assert max(waits) == MAX_BACKOFF_SECONDS


@pytest.mark.usefixtures("retry_settings")
@pytest.mark.parametrize(("drawn", "retry_after", "wait"), [(0.0, 42.0, 42.0), (9.0, 3.0, 9.0)])
def test_a_429_waits_at_least_its_retry_after(
    monkeypatch: pytest.MonkeyPatch, drawn: float, retry_after: float, wait: float
) -> None:
    monkeypatch.setattr(random, "uniform", lambda low, high: drawn)
    limited = ModelRateLimited("the model provider answered 429", retry_after=retry_after)
    assert RetryPolicy(prior=0).wait(failed_attempt(4, limited)) == wait


@pytest.mark.usefixtures("jitter")
def test_the_failures_counted_include_those_of_earlier_messages() -> None:
    policy = RetryPolicy(prior=2)
    policy.wait(failed_attempt(2))
    assert policy.failures == 4


@pytest.mark.usefixtures("retry_settings")
@pytest.mark.parametrize(
    ("prior", "attempt", "stop"),
    [(0, MAX_ATTEMPTS - 1, False), (0, MAX_ATTEMPTS, True), (3, 1, False), (3, 2, True)],
)
def test_retries_stop_once_the_step_made_max_attempts_calls_across_its_messages(
    prior: int, attempt: int, stop: bool
) -> None:
    assert RetryPolicy(prior=prior).stop(failed_attempt(attempt)) is stop


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
    configure: Configure, monkeypatch: pytest.MonkeyPatch
) -> None:
    configure(RATCHET_MODEL_RETRY_INLINE_MAX_SECONDS="1.5")
    slept: list[float] = []
    this_thread, real_sleep = threading.get_ident(), time.sleep

    def sleep(seconds: float) -> None:
        # This thread's sleeps only: another test's threads in this process (a heartbeat)
        # sleep through the same function, and must go on sleeping for real.
        if threading.get_ident() == this_thread:
            slept.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    policy = RetryPolicy(prior=0)

    policy.sleep(1.5)  # the maximum itself
    with pytest.raises(Deferred):
        policy.sleep(1.501)
    assert slept == [1.5]
