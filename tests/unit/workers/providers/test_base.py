"""The provider plumbing every model shares: which of a provider's errors are worth another try,
its Retry-After, and its tool arguments.

A provider's error is transient (a timeout, a lost connection, a 429, a 5xx: retried, the
429 after its Retry-After) or permanent (the request is wrong: the task fails). Tool arguments
that are no JSON object are kept raw, for the error the model is shown.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.errors import ModelPermanentError, ModelRateLimited, ModelTransientError
from workers.providers import anthropic as anthropic_provider
from workers.providers import openai as openai_provider
from workers.providers.base import classify_error, parse_arguments, parse_retry_after

# --- classify_error, with an SDK's three error classes -------------------------------------------


class Timeout(Exception):
    pass


class Connection(Exception):
    pass


class Status(Exception):
    def __init__(self, status_code: int, headers: dict[str, str] | None = None) -> None:
        super().__init__("refused")
        self.status_code = status_code
        self.message = "refused"
        self.response = type("Response", (), {"headers": headers or {}})()


def classify(exc: Exception, **kwargs: Any) -> Exception:
    return classify_error(exc, timeout=Timeout, connection=Connection, status=Status, **kwargs)


@pytest.mark.parametrize("code", [408, 500, 503, 599])
def test_timeouts_and_server_errors_are_transient(code: int) -> None:
    error = classify(Status(code))
    assert isinstance(error, ModelTransientError)
    assert not isinstance(error, ModelRateLimited)
    assert str(code) in str(error)


@pytest.mark.parametrize("code", [400, 401, 404, 422])
def test_client_errors_are_permanent(code: int) -> None:
    assert isinstance(classify(Status(code)), ModelPermanentError)


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (Timeout(), ModelTransientError),
        (Connection("reset by peer"), ModelTransientError),
        (ValueError("a bug in the SDK glue"), ModelPermanentError),
    ],
)
def test_timeouts_and_lost_connections_are_transient_anything_unknown_permanent(
    exc: Exception, kind: type[Exception]
) -> None:
    assert type(classify(exc)) is kind


def test_a_provider_may_name_more_transient_statuses() -> None:
    assert isinstance(classify(Status(425)), ModelPermanentError)
    assert isinstance(classify(Status(425), transient_statuses=(425,)), ModelTransientError)


@pytest.mark.parametrize(
    ("code", "headers", "kind", "retry_after"),
    [
        (429, {"retry-after": "12"}, ModelRateLimited, 12.0),
        (429, {}, ModelRateLimited, None),  # no header: the policy's own backoff decides
        (503, {"retry-after": "3"}, ModelTransientError, 3.0),
    ],
)
def test_a_429_is_rate_limited_and_any_transient_status_carries_its_retry_after(
    code: int, headers: dict[str, str], kind: type[Exception], retry_after: float | None
) -> None:
    error = classify(Status(code, headers))
    assert type(error) is kind
    assert isinstance(error, ModelTransientError)
    assert error.retry_after == retry_after


# --- the SDKs' own errors, as their providers map them -------------------------------------------

REQUEST = httpx.Request("POST", "https://provider.invalid/v1/chat")


def response(code: int, **headers: str) -> httpx.Response:
    return httpx.Response(code, headers=headers, request=REQUEST)


def test_openai_errors_map_to_the_same_rule() -> None:
    limited = openai_provider.map_error(
        openai.RateLimitError(
            "slow down", response=response(429, **{"Retry-After": "7"}), body=None
        )
    )
    assert isinstance(limited, ModelRateLimited)
    assert limited.retry_after == 7.0
    assert isinstance(
        openai_provider.map_error(openai.APITimeoutError(request=REQUEST)), ModelTransientError
    )
    assert isinstance(
        openai_provider.map_error(openai.APIConnectionError(request=REQUEST)), ModelTransientError
    )
    bad = openai.BadRequestError("no such model", response=response(400), body=None)
    assert isinstance(openai_provider.map_error(bad), ModelPermanentError)


@pytest.mark.parametrize(("code", "kind"), [(529, ModelTransientError), (401, ModelPermanentError)])
def test_anthropic_overloaded_is_transient_and_a_bad_key_permanent(
    code: int, kind: type[Exception]
) -> None:
    error = anthropic.APIStatusError("no", response=response(code), body=None)
    assert isinstance(anthropic_provider.map_error(error), kind)


# --- Retry-After ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("7", 7.0),
        ("0.25", 0.25),
        ("0", 0.0),
        ("-5", 0.0),  # never a negative wait
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # a date gone by: no wait
        (None, None),
        ("", None),
        ("soon", None),
    ],
)
def test_retry_after_is_read_as_seconds_or_an_http_date(
    header: str | None, seconds: float | None
) -> None:
    assert parse_retry_after(header) == seconds


def test_a_retry_after_date_to_come_is_the_time_until_then() -> None:
    wait = parse_retry_after("Fri, 31 Dec 9999 23:59:59 GMT")
    assert wait is not None
    assert wait > 100 * 365 * 86400


@given(seconds=st.floats(min_value=0, max_value=1e9, allow_nan=False))
def test_delta_seconds_are_read_exactly(seconds: float) -> None:
    assert parse_retry_after(repr(seconds)) == seconds


@given(header=st.text(max_size=40))
def test_any_retry_after_header_is_a_wait_of_zero_or_more_or_none(header: str) -> None:
    wait = parse_retry_after(header)
    assert wait is None or 0 <= wait < float("inf")


@pytest.mark.parametrize("header", ["inf", "Infinity", "1e999", "nan", "-inf"])
def test_a_retry_after_that_is_no_finite_wait_is_ignored(header: str) -> None:
    # An infinite wait would overflow the step's milliseconds and fail the task.
    assert parse_retry_after(header) is None


def test_retry_after_accepts_seconds_and_http_dates() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None


def test_malformed_tool_arguments_are_kept_raw() -> None:
    assert parse_arguments('{"a": 1}') == ({"a": 1}, None)
    assert parse_arguments("{oops") == ({}, "{oops")
    assert parse_arguments("[1]") == ({}, "[1]")
