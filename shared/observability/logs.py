"""Logging for every Ratchet process: plain text, or one JSON object a line.

``RATCHET_LOG_FORMAT=json`` writes each record as one line of JSON with ``time``, ``level``,
``logger`` and ``message``, the exception's traceback as ``exc_info``, and the fields of the
step it happened in (``task_id``, ``step``, ``lease_epoch``), so a log store can follow a task
across workers. Text lines carry the same fields at their end.

A step binds its fields with :func:`bound`; anything logged inside (by Ratchet, an agent's
tool, or a library) carries them. Ratchet's own log calls name tasks, steps, models and
hosts, never keys, webhook secrets or request bodies. httpx's own line for each request it
sends names the URL: its user info and query values are redacted (:class:`RedactUrls`). The
values of the tenant secrets handed to tool calls running in the process are redacted from
every record (``shared.observability.redaction``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from shared.observability.redaction import RedactSecrets

FIELDS = ("task_id", "step", "lease_epoch")
_bound: ContextVar[dict[str, Any]] = ContextVar("ratchet_log_fields", default={})  # noqa: B039 - never mutated
_HANDLER_NAME = "ratchet"
REDACTED = "REDACTED"
# Loggers that put the URLs a process sends to in their records' arguments.
URL_LOGGERS = ("httpx",)


@contextlib.contextmanager
def bound(**fields: Any) -> Iterator[None]:
    """Add ``fields`` to every record logged inside the block (in this thread or task)."""
    token = _bound.set({**_bound.get(), **fields})
    try:
        yield
    finally:
        _bound.reset(token)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The step's bound fields, and any passed with ``extra=`` (those win)."""
    found = {name: value for name, value in _bound.get().items() if value is not None}
    for name in FIELDS:
        value = getattr(record, name, None)
        if value is not None:
            found[name] = value
    return found


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            # A filter may have set the text already (RedactSecrets, redacted): keep it.
            line["exc_info"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = _fields(record)
        if not fields:
            return text
        head, newline, rest = text.partition("\n")  # after the message, before a traceback
        tail = " ".join(f"{name}={value}" for name, value in fields.items())
        return f"{head} [{tail}]{newline}{rest}"


def redact_url(url: str) -> str:
    """``url`` without its credentials: no ``user:password@``, and each query value
    replaced (a webhook's or a tool's URL may carry a token in either); the names stay, so
    the line still says where the request went."""
    try:
        parts = urlsplit(url)
        host = parts.netloc.rpartition("@")[2]
        query = [(k, REDACTED) for k, _ in parse_qsl(parts.query, keep_blank_values=True)]
        return urlunsplit(parts._replace(netloc=host, query=urlencode(query), fragment=""))
    except ValueError:  # not a URL after all (a bad port, a bad IPv6 literal)
        return REDACTED


class RedactUrls(logging.Filter):
    """Redacts the URLs in a record's arguments (httpx logs ``HTTP Request: POST <url>
    "HTTP/1.1 200 OK"`` at INFO, its URL an argument): an ``httpx.URL`` or a string that
    holds ``://``. Other arguments, the status code among them, are left as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_redacted_arg(arg) for arg in record.args)
        return True


def _redacted_arg(arg: object) -> object:
    if type(arg).__name__ == "URL" or (isinstance(arg, str) and "://" in arg):
        return redact_url(str(arg))
    return arg


def configure(*, log_format: str, level: str | int, capture_warnings: bool = False) -> None:
    """Send every logger's records (uvicorn's and Celery's included, and Python's warnings
    with ``capture_warnings``) to stderr in the chosen format. Safe to call again: it replaces
    its own handler."""
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RedactSecrets())  # the values of tenant secrets handed to running calls
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "celery"):
        logger = logging.getLogger(name)
        logger.handlers.clear()  # theirs would print the same record a second time, unformatted
        logger.propagate = True
    # Alembic's plugin registry says hello at INFO in every process that checks the schema.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    for name in URL_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactUrls) for f in logger.filters):
            logger.addFilter(RedactUrls())
    logging.captureWarnings(capture_warnings)


def configure_from_settings(level: str | int | None = None, *, replace: bool = True) -> None:
    """:func:`configure` with ``RATCHET_LOG_FORMAT`` and ``level`` (else ``RATCHET_LOG_LEVEL``);
    with ``replace=False``, only if this process has not been configured yet."""
    from shared.settings import get_settings

    if not replace and any(h.get_name() == _HANDLER_NAME for h in logging.getLogger().handlers):
        return
    settings = get_settings()
    configure(
        log_format=settings.log_format, level=level or settings.log_level, capture_warnings=True
    )
