"""One step's model call: inside the fleet's rate limits, with retries, feeding back 429s.

For each attempt: wait for every bucket the call must pass (briefly in the worker, otherwise
through the queue), call the provider, then correct the token buckets with the real usage.
A provider 429 pauses that model for the whole fleet for its Retry-After. Transient errors
retry with exponential backoff and full jitter; a backoff too long to sleep through, like a
long rate-limit wait, becomes :class:`Deferred` so the step goes back on the queue and holds
no worker.

The provider is asked on the process's model-call pool (``cancels.call``), and each attempt
has a deadline it cannot outlive (``RATCHET_MODEL_CALL_DEADLINE_SECONDS``): the SDKs' own
timeout bounds each read, so a server that sends a byte now and then could hold an attempt
forever. An attempt past its deadline is abandoned and fails as the provider's timeout does,
transient. The step waits for the attempts and the backoffs between them without its turn,
and a cancel of its task cuts either short (``cancels.Interrupted``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from datetime import UTC, datetime
from functools import partial
from typing import Any

from tenacity import RetryCallState, Retrying, retry_if_exception_type

from shared.errors import LeaseLost, ModelError, ModelRateLimited, ModelTransientError
from shared.observability import metrics
from shared.ratelimit import rules
from shared.ratelimit.buckets import LimiterUnavailable, Take
from shared.ratelimit.limiter import get_limiter
from shared.settings import get_settings
from workers import cancels, tokens
from workers.gatherer import Live
from workers.providers import ModelRequest, ModelResponse, Provider

log = logging.getLogger("ratchet.model")
MAX_BACKOFF_SECONDS = 600.0
DEFAULT_OUTPUT_ESTIMATE = 512
LIMITER_DOWN_RETRY_SECONDS = 2.0


class Deferred(Exception):
    """Come back for this step later, through the queue: the wait is too long to hold a worker."""

    def __init__(
        self, delay_s: float, *, reason: dict[str, Any], failures: int | None = None
    ) -> None:
        super().__init__(f"retry in {delay_s:.1f} s: {reason}")
        self.delay_s = delay_s
        self.reason = reason
        self.failures = failures


class RetryPolicy:
    """Exponential backoff with full jitter, honouring Retry-After, counted across messages.

    ``prior`` is how many calls of this step already failed (persisted on the task), so a
    step that is re-queued for a long backoff keeps its place in the schedule.
    """

    def __init__(self, prior: int) -> None:
        settings = get_settings()
        self.prior = prior
        self.base = settings.model_retry_base_seconds
        self.max_attempts = settings.model_max_attempts
        self.inline_max = settings.model_retry_inline_max_seconds
        self.failures = prior

    def wait(self, state: RetryCallState) -> float:
        self.failures = self.prior + state.attempt_number
        exc = state.outcome.exception() if state.outcome else None
        jitter = random.uniform(0, min(MAX_BACKOFF_SECONDS, self.base * 2 ** (self.failures - 1)))
        return max(jitter, getattr(exc, "retry_after", None) or 0.0)

    def stop(self, state: RetryCallState) -> bool:
        return self.prior + state.attempt_number >= self.max_attempts

    def sleep(self, seconds: float) -> None:
        if seconds > self.inline_max:
            raise Deferred(seconds, reason={"reason": "retry_backoff"}, failures=self.failures)
        cancels.pause(seconds)


def complete(
    provider: Provider,
    request: ModelRequest,
    *,
    model: str,
    tenant: str,
    prior_failures: int,
    failed: list[dict[str, Any]] | None = None,
    still_held: Callable[[], bool] = lambda: True,
    live: Live | None = None,
) -> ModelResponse:
    """The model's answer; raises ModelError (give up) or Deferred (come back later). Each
    failed call is added to ``failed`` (when, how long, the error), for the step timeline.
    Before each call, ``still_held()`` must say the step's lease is still this worker's, or
    LeaseLost is raised: a stalled worker does not pay for an answer it could not commit.
    Given ``live``, each attempt streams its answer to the task's live readers."""
    policy = RetryPolicy(prior=prior_failures)
    call = partial(
        limited_call,
        provider,
        request,
        model=model,
        tenant=tenant,
        failed=failed,
        still_held=still_held,
        live=live,
    )
    # The first attempt runs outside the retry machinery (most calls succeed at once, and
    # tenacity's bookkeeping costs a call about what the rest of it does with an instant
    # model); a transient failure is then handed to it as its own first attempt's, so the
    # retries, their waits and the count of attempts are the same as if it had made it.
    try:
        return call()
    except ModelTransientError as exc:
        first = exc
    except ModelError as exc:
        _count_attempts(exc, policy.prior + 1)
        raise
    return _retried(call, policy, first=first)


def _retried(
    call: Callable[[], ModelResponse], policy: RetryPolicy, *, first: ModelTransientError
) -> ModelResponse:
    """The retries after a transient ``first`` failure, as tenacity's loop (``first`` its
    first attempt's outcome)."""
    pending = [first]

    def attempt() -> ModelResponse:
        if pending:
            raise pending.pop()
        return call()

    retrying = Retrying(
        retry=retry_if_exception_type(ModelTransientError),
        wait=policy.wait,
        stop=policy.stop,
        sleep=policy.sleep,
        reraise=True,
    )
    try:
        return retrying(attempt)
    except ModelError as exc:
        _count_attempts(exc, policy.prior + retrying.statistics.get("attempt_number", 1))
        raise


def _count_attempts(exc: ModelError, attempts: int) -> None:
    """Say in ``exc``'s message how many attempts the step's call has had."""
    exc.args = (f"{exc} (after {attempts} attempts)",)


def limited_call(
    provider: Provider,
    request: ModelRequest,
    *,
    model: str,
    tenant: str,
    failed: list[dict[str, Any]] | None = None,
    still_held: Callable[[], bool] = lambda: True,
    live: Live | None = None,
) -> ModelResponse:
    """One provider call inside every bucket that applies; the buckets see the real usage."""
    estimate = partial(
        tokens.request_tokens, request, model, default_output=DEFAULT_OUTPUT_ESTIMATE
    )
    takes = rules.call_takes(model, tenant, estimate)
    wait_for_capacity(takes, model)
    started, started_at = time.perf_counter(), datetime.now(UTC)
    try:
        response = ask(provider, request, live=live, still_held=still_held)
    except LeaseLost:
        _refund(takes)
        raise
    except ModelError as exc:
        if failed is not None:
            failed.append(failed_call(exc, started_at, time.perf_counter() - started))
        _after_error(exc, takes, model)
        raise
    except cancels.Interrupted:
        _refund(takes)  # cancelled: no answer will be used
        raise
    metrics.model_calls.labels(model=model, outcome="ok").inc()
    metrics.model_seconds.labels(model=model).observe(time.perf_counter() - started)
    metrics.model_tokens.labels(model=model, kind="input").inc(response.input_tokens)
    metrics.model_tokens.labels(model=model, kind="output").inc(response.output_tokens)
    used = response.input_tokens + response.output_tokens
    changes = [(take, used - take.cost) for take in takes if take.bucket.scope.endswith(":tokens")]
    _safely(lambda: get_limiter().adjust(changes))
    return response


def ask(
    provider: Provider,
    request: ModelRequest,
    *,
    live: Live | None = None,
    still_held: Callable[[], bool] = lambda: True,
) -> ModelResponse:
    """One attempt: the provider's answer, on the model-call pool, within the attempt's
    deadline; past it the attempt is abandoned and fails as transient. The pool's thread
    asks ``still_held()`` last thing before the request goes out (LeaseLost if not): the
    shorter the way from that check to the provider, the less a stall can slip in between.

    Given ``live`` the attempt streams; a cancel of the task shuts its stream at once, and so
    does its end however it ends (an abandoned call streams no further). Its last deltas are
    handed over before its answer is returned, so they reach readers before its commit."""
    deadline = attempt_deadline()
    deltas = live.attempt() if live is not None else None
    watch = cancels.current()
    asked = request if deltas is None else replace(request, deltas=deltas)

    def work() -> ModelResponse:
        if not still_held():
            raise LeaseLost(f"task {request.task_id}: its lease may have run out; not asking")
        return provider.complete(asked)

    try:
        with nullcontext() if watch is None or deltas is None else watch.stopping(deltas.stop):
            return cancels.call(work, timeout=deadline, name="model", pool=cancels.MODEL)
    except TimeoutError:
        raise ModelTransientError(
            f"the model provider did not answer within the call's {deadline:g} s deadline"
        ) from None
    finally:
        if deltas is not None:
            deltas.finish()


def attempt_deadline() -> float:
    """How long one attempt may take in all: the setting, else twice the SDKs' timeout (which
    bounds each read, and so an answer that takes that long to begin and as long again to
    arrive)."""
    settings = get_settings()
    return settings.model_call_deadline_seconds or 2 * settings.model_timeout_seconds


def failed_call(exc: ModelError, started_at: datetime, seconds: float) -> dict[str, Any]:
    return {
        "started_at": started_at.isoformat(),
        "latency_ms": int(seconds * 1000),
        "error": {"type": exc.error_type, "message": str(exc)[:500]},
    }


def _after_error(exc: ModelError, takes: list[Take], model: str) -> None:
    """A failed call used none of its tokens; a 429 pauses the model for the whole fleet."""
    _refund(takes)
    if not isinstance(exc, ModelRateLimited):
        metrics.model_calls.labels(model=model, outcome=exc.error_type).inc()
        return
    metrics.model_calls.labels(model=model, outcome="rate_limited").inc()
    pause = exc.retry_after or get_settings().provider_block_default_seconds
    _safely(lambda: get_limiter().block(model, pause))
    log.warning("%s answered 429: pausing it fleet-wide for %.1f s", model, pause)
    _safely(lambda: _adapt(model, pause))


def _adapt(model: str, pause_s: float) -> None:
    share = rules.after_429(model, pause_s=pause_s)
    if share is not None:
        log.warning(
            "%s: adaptive limits now allow %.0f%% of its configured rates", model, 100 * share
        )


def wait_for_capacity(takes: list[Take], model: str) -> None:
    """Return once every bucket has granted; a short wait sleeps here, a long one defers."""
    inline_ms = get_settings().rate_limit_inline_wait_ms
    limiter = get_limiter()
    while True:
        try:
            decision = limiter.acquire(takes, blocks=[model])
        except LimiterUnavailable as exc:
            # Never call the provider unguarded: wait for the limiter to come back.
            raise Deferred(
                LIMITER_DOWN_RETRY_SECONDS,
                reason={"reason": "limiter_unavailable", "detail": str(exc)},
            ) from exc
        if decision.allowed:
            metrics.limiter_decisions.labels(scope=model, decision="allowed").inc()
            return
        scope = decision.scope or model
        metrics.limiter_decisions.labels(scope=scope, decision="denied").inc()
        metrics.limiter_wait_seconds.labels(scope=scope).inc(decision.retry_after_ms / 1000)
        if decision.retry_after_ms > inline_ms:
            reason = {
                "reason": "rate_limited",
                "scope": decision.scope,
                "wait_ms": decision.retry_after_ms,
            }
            raise Deferred(decision.retry_after_ms / 1000, reason=reason)
        cancels.pause(decision.retry_after_ms / 1000)


def _refund(takes: list[Take]) -> None:
    changes = [(take, -take.cost) for take in takes if take.bucket.scope.endswith(":tokens")]
    _safely(lambda: get_limiter().adjust(changes))


def _safely(action: Any) -> None:
    try:
        action()
    except LimiterUnavailable:
        log.warning("rate limiter unavailable; bucket correction skipped")
