"""Path, query and header parameters checked before any of them reaches the database, and
the cursors a list's pages hand out."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Annotated, Protocol, TypeVar

from fastapi import Query, Request

from shared.errors import InvalidRequest

# Event sequence numbers and step numbers are PostgreSQL ``integer`` columns.
MAX_SEQ = 2**31 - 1

# A list's page: ``limit: PageLimit = 50`` (each list says its default), ``cursor: PageCursor =
# None``, read with ``cursor_after``.
PageLimit = Annotated[int, Query(ge=1, le=200, description="at most this many")]
PageCursor = Annotated[
    str | None, Query(max_length=200, description="``next_cursor`` of the page before")
]


class Listed(Protocol):
    """A row a list pages through by its id."""

    @property
    def id(self) -> str: ...


Row = TypeVar("Row", bound=Listed)


def encode_cursor(value: str) -> str:
    """An opaque page cursor for ``value`` (a row id or number) in a list's ``next_cursor``."""
    return base64.urlsafe_b64encode(value.encode()).decode().rstrip("=")


def next_cursor(last: str | None) -> str | None:
    """The ``next_cursor`` after a page whose store query named the last row it listed
    (``last``, None when no page follows)."""
    return encode_cursor(last) if last else None


def page_of(rows: Sequence[Row], limit: int) -> tuple[Sequence[Row], str | None]:
    """The page of ``rows`` fetched ``limit + 1`` (one past the page says another follows):
    its first ``limit``, and the ``next_cursor`` after the last one's id (None on the last
    page)."""
    page = rows[:limit]
    return page, encode_cursor(page[-1].id) if len(rows) > limit else None


def decode_cursor(cursor: str) -> str:
    """Strictly: anything this API did not hand out is a ValueError."""
    try:
        raw = base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_", validate=True)
        value = raw.decode()
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError("malformed cursor") from exc
    if not value or not value.isprintable():  # no cursor holds a NUL or control character
        raise ValueError("malformed cursor")
    return value


async def reject_nul(request: Request) -> None:
    """Refuse a NUL character in any path or query parameter: PostgreSQL cannot compare text
    with one. An app-wide dependency, ``async`` so it costs no worker thread."""
    named = [*request.path_params.items(), *request.query_params.multi_items()]
    for name, value in named:
        if isinstance(value, str) and "\x00" in value:
            raise InvalidRequest(name, "must not contain the NUL character (\\u0000)")


def parse_seq(value: str, *, field: str) -> int:
    """A sequence number sent as text (``Last-Event-ID``, a step cursor): ASCII digits only
    (``str.isdigit`` also passes ``²``, which ``int`` refuses) and within the column's range."""
    if not (value.isascii() and value.isdigit()) or int(value) > MAX_SEQ:
        raise InvalidRequest(field, f"must be a whole number from 0 to {MAX_SEQ}")
    return int(value)


def event_start(after: int | None, last_event_id: str | None) -> int:
    """Where an event stream starts: after ``?after=``, else after ``Last-Event-ID``, else 0."""
    if after is not None:
        if not 0 <= after <= MAX_SEQ:
            raise InvalidRequest("after", f"must be a whole number from 0 to {MAX_SEQ}")
        return after
    if last_event_id is None:
        return 0
    return parse_seq(last_event_id.strip(), field="Last-Event-ID")


def event_position(after: int | None, last_event_id: str | None) -> tuple[int, int]:
    """Where an event stream starts: ``(seq, pos)``, after the committed event ``seq`` and the
    live delta at ``pos`` of the call that followed it (0: none; ``shared.deltas``). From
    ``?after=`` (a seq), else ``Last-Event-ID`` (a seq, or a delta's ``<seq>.<pos>``), else
    the start."""
    if after is not None or last_event_id is None or "." not in last_event_id:
        return event_start(after, last_event_id), 0
    seq, _, pos = last_event_id.strip().partition(".")
    if not (pos.isascii() and pos.isdigit()) or len(pos) > MAX_POSITION_DIGITS:
        raise InvalidRequest("Last-Event-ID", "must be an event id this stream sent")
    return parse_seq(seq, field="Last-Event-ID"), int(pos)


MAX_POSITION_DIGITS = 24


def cursor_after(cursor: str | None) -> str | None:
    """What a ``next_cursor`` this API returned points after; a 422 naming ``cursor`` for
    anything else."""
    if cursor is None or cursor == "":
        return None
    try:
        return decode_cursor(cursor)
    except ValueError:
        raise InvalidRequest("cursor", "not a cursor this API returned") from None
