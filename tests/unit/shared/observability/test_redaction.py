"""Redaction of tenant secrets' values: from a JSON result, and from log records while the
calls that hold them run (their message, arguments and traceback), and not after."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from shared.observability.logs import JsonFormatter, TextFormatter
from shared.observability.redaction import RedactSecrets, in_flight, redact, redact_text

SECRETS = {"TOKEN": "s3cr3t-value", "LONGER": "s3cr3t-value-and-more"}


def test_a_json_value_is_redacted_in_strings_and_keys_and_the_longest_value_first() -> None:
    value = {
        "s3cr3t-value": ["a s3cr3t-value-and-more b", 1, None, {"x": "s3cr3t-value"}],
        "n": 3.5,
    }
    assert redact(value, SECRETS) == {
        "[secret:TOKEN]": ["a [secret:LONGER] b", 1, None, {"x": "[secret:TOKEN]"}],
        "n": 3.5,
    }
    assert redact(value, {}) is value  # nothing handed: nothing walked


def test_an_empty_value_redacts_nothing() -> None:
    assert redact_text("anything", {"EMPTY": ""}) == "anything"


@pytest.fixture
def handler() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    out = io.StringIO()
    stream = logging.StreamHandler(out)
    stream.setFormatter(TextFormatter())
    stream.addFilter(RedactSecrets())
    logger = logging.getLogger("tests.redaction")
    logger.addHandler(stream)
    logger.propagate = False
    yield logger, out
    logger.removeHandler(stream)
    logger.propagate = True


def test_records_logged_while_a_call_holds_secrets_are_redacted(
    handler: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = handler
    with in_flight({"TOKEN": "s3cr3t-value"}):
        logger.warning("calling with %s", "s3cr3t-value")
        try:
            raise RuntimeError("refused s3cr3t-value")
        except RuntimeError:
            logger.exception("the call failed")
    text = out.getvalue()
    assert "s3cr3t-value" not in text
    assert "calling with [secret:TOKEN]" in text
    assert "RuntimeError: refused [secret:TOKEN]" in text


def test_two_calls_holding_one_value_keep_it_redacted_until_both_end(
    handler: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = handler
    with in_flight({"TOKEN": "s3cr3t-value"}):
        with in_flight({"TOKEN": "s3cr3t-value"}):
            pass
        logger.warning("still %s", "s3cr3t-value")
    logger.warning("after %s", "s3cr3t-value")  # no call holds it: not known any more
    assert out.getvalue().splitlines()[0].endswith("still [secret:TOKEN]")
    assert out.getvalue().splitlines()[1].endswith("after s3cr3t-value")


def test_the_json_formatter_keeps_the_redacted_traceback() -> None:
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", None, None)
    try:
        raise ValueError("s3cr3t-value")
    except ValueError:
        import sys

        record.exc_info = sys.exc_info()
    with in_flight({"TOKEN": "s3cr3t-value"}):
        RedactSecrets().filter(record)
    line = JsonFormatter().format(record)
    assert "s3cr3t-value" not in line
    assert "[secret:TOKEN]" in line
