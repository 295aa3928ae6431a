"""Page cursors and sequence numbers, checked before they reach the database.

A cursor is opaque and URL-safe, and decodes back to exactly what was encoded; anything this
API could not have handed out is refused, naming the parameter. A sequence number is ASCII
digits within a PostgreSQL ``integer``.
"""

from __future__ import annotations

import base64
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.params import (
    MAX_SEQ,
    cursor_after,
    decode_cursor,
    encode_cursor,
    event_position,
    event_start,
    parse_seq,
)
from shared.errors import InvalidRequest

PRINTABLE = st.text(min_size=1).filter(str.isprintable)
URL_SAFE = set(string.ascii_letters + string.digits + "-_")


def raw_cursor(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


# --- cursors -------------------------------------------------------------------------------------


@given(value=PRINTABLE)
def test_a_cursor_decodes_to_exactly_what_was_encoded(value: str) -> None:
    assert decode_cursor(encode_cursor(value)) == value
    assert cursor_after(encode_cursor(value)) == value


@given(value=PRINTABLE)
def test_a_cursor_is_url_safe_without_padding(value: str) -> None:
    assert set(encode_cursor(value)) <= URL_SAFE


@pytest.mark.parametrize(
    "cursor",
    [
        "",
        "a",  # no base64 text is one character long
        "YW Jj",
        "YW=j",  # padding inside
        raw_cursor(b"\x00"),
        raw_cursor(b"page\n2"),
        raw_cursor(b"\xff\xfe"),  # not UTF-8
    ],
)
def test_a_cursor_this_api_could_not_have_handed_out_is_refused(cursor: str) -> None:
    with pytest.raises(ValueError, match="malformed cursor"):
        decode_cursor(cursor)


@pytest.mark.parametrize("cursor", [None, ""])
def test_no_cursor_means_the_first_page(cursor: str | None) -> None:
    assert cursor_after(cursor) is None


def test_a_malformed_cursor_is_a_422_naming_the_cursor() -> None:
    with pytest.raises(InvalidRequest) as refused:
        cursor_after("not a cursor!")
    assert refused.value.field == "cursor"


# --- sequence numbers ----------------------------------------------------------------------------


@given(seq=st.integers(0, MAX_SEQ))
def test_every_sequence_number_in_range_reads_back(seq: int) -> None:
    assert parse_seq(str(seq), field="Last-Event-ID") == seq


def test_leading_zeros_are_read_as_the_number() -> None:
    assert parse_seq("007", field="after") == 7


@pytest.mark.parametrize(
    "text",
    [
        "",
        "-1",
        "+1",
        "1.0",
        "²",  # a digit to str.isdigit, not to int
        "١٢",  # Arabic-Indic digits: int reads them, the database column never sees them
        str(MAX_SEQ + 1),
    ],
)
def test_anything_but_ascii_digits_within_an_integer_column_is_refused(text: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_seq(text, field="Last-Event-ID")
    assert refused.value.field == "Last-Event-ID"


@pytest.mark.parametrize(
    ("after", "last_event_id", "start"),
    [
        (None, None, 0),
        (None, " 42 ", 42),  # a header's surrounding blanks do not count
        (7, "42", 7),  # ?after= wins over the header
        (0, "42", 0),
        (MAX_SEQ, None, MAX_SEQ),
    ],
)
def test_a_stream_starts_after_the_query_then_the_header_then_at_the_beginning(
    after: int | None, last_event_id: str | None, start: int
) -> None:
    assert event_start(after, last_event_id) == start


@pytest.mark.parametrize(
    ("after", "last_event_id", "field"),
    [(-1, None, "after"), (MAX_SEQ + 1, None, "after"), (None, "abc", "Last-Event-ID")],
)
def test_a_stream_start_out_of_range_is_refused_naming_its_source(
    after: int | None, last_event_id: str | None, field: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        event_start(after, last_event_id)
    assert refused.value.field == field


@pytest.mark.parametrize(
    ("after", "last_event_id", "position"),
    [
        (None, None, (0, 0)),
        (None, "42", (42, 0)),
        (None, " 42.1732752000123000 ", (42, 1732752000123000)),  # a live delta's id
        (7, "42.5", (7, 0)),  # ?after= wins over the header
    ],
)
def test_a_stream_resumes_after_a_committed_event_or_a_live_delta(
    after: int | None, last_event_id: str | None, position: tuple[int, int]
) -> None:
    assert event_position(after, last_event_id) == position


@pytest.mark.parametrize(
    "last_event_id", ["1.", "1.x", "x.1", "1.2.3", f"{MAX_SEQ + 1}.1", "1." + "9" * 25]
)
def test_a_delta_id_this_stream_never_sent_is_refused(last_event_id: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        event_position(None, last_event_id)
    assert refused.value.field == "Last-Event-ID"
