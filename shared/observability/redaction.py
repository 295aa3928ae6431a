"""Keeping tenant secrets' values out of what Ratchet stores and shows.

A tool call is handed the secrets its tool declares. What comes back from it (its result, its
error) has each of those values replaced by ``[secret:NAME]`` before anything stores or shows
it (:func:`redact`), so the ledger, the events, webhooks, ``/steps``, the dashboard and the
model only ever hold the redacted form. While calls run, their values are registered
(:func:`in_flight`) and :class:`RedactSecrets`, a filter on every process's log handler,
redacts them from any record logged meanwhile (by the tool, a library, or Ratchet quoting the
tool's exception). With nothing in flight the filter costs one dictionary check per record.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any


def marker(name: str) -> str:
    return f"[secret:{name}]"


def redact_text(text: str, secrets: Mapping[str, str]) -> str:
    """``text`` with each secret's value replaced by its marker."""
    return _replace(text, _longest_first((value, name) for name, value in secrets.items()))


def _longest_first(pairs: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """(value, name) pairs, the longest value first, so a value that holds another is
    replaced whole; empty values dropped."""
    return tuple(sorted((pair for pair in pairs if pair[0]), key=lambda pair: -len(pair[0])))


def _replace(text: str, pairs: tuple[tuple[str, str], ...]) -> str:
    for value, name in pairs:
        if value in text:
            text = text.replace(value, marker(name))
    return text


def redact(value: Any, secrets: Mapping[str, str]) -> Any:
    """A JSON value with each secret's value redacted from its strings (object keys too)."""
    if not secrets:
        return value
    if isinstance(value, str):
        return redact_text(value, secrets)
    if isinstance(value, list):
        return [redact(item, secrets) for item in value]
    if isinstance(value, dict):
        return {redact_text(k, secrets): redact(v, secrets) for k, v in value.items()}
    return value


class _InFlight:
    """The values of the secrets handed to calls now running in this process (counted: two
    calls may hold the same secret), with their names."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()  # (value, name)
        # (value, name), read without the lock by the log filter: replaced whole, never
        # changed in place.
        self.pairs: tuple[tuple[str, str], ...] = ()

    def add(self, secrets: Mapping[str, str]) -> None:
        with self._lock:
            self._counts.update((value, name) for name, value in secrets.items())
            self._publish()

    def remove(self, secrets: Mapping[str, str]) -> None:
        with self._lock:
            self._counts.subtract((value, name) for name, value in secrets.items())
            self._counts = +self._counts  # drop what no call holds any more
            self._publish()

    def _publish(self) -> None:
        # By value: a name may stand for different values in different tenants' calls.
        self.pairs = _longest_first(self._counts)


_in_flight = _InFlight()


@contextlib.contextmanager
def in_flight(secrets: Mapping[str, str]) -> Iterator[None]:
    """Register ``secrets``' values for the log filter while the block (a tool call) runs."""
    if not secrets:
        yield
        return
    _in_flight.add(secrets)
    try:
        yield
    finally:
        _in_flight.remove(secrets)


class RedactSecrets(logging.Filter):
    """Redacts the values of the secrets in flight from a record's message and its
    exception's text (the record is changed in place, for every handler after this one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        pairs = _in_flight.pairs
        if not pairs:
            return True
        try:
            message = record.getMessage()
        except Exception:
            return True  # a record that cannot be formatted: logging reports it itself
        redacted = _replace(message, pairs)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = _replace(record.exc_text, pairs)
        if record.stack_info:
            record.stack_info = _replace(record.stack_info, pairs)
        return True
