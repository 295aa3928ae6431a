"""``shared.deltas``: event ids that order live deltas with the committed events, and the
reader's cursor that sends only the deltas of the call in progress."""

from __future__ import annotations

import pytest

from shared.deltas import Cursor, Delta, event_id, parse_event_id


def delta(pos: int, after: int, step: int = 1) -> Delta:
    return Delta(pos, "delta", step, after, "{}")


@pytest.mark.parametrize(
    ("text", "position"), [("12", (12, 0)), ("12.3400", (12, 3400)), ("0.1", (0, 1))]
)
def test_an_event_id_is_a_seq_or_a_seq_and_a_position(text: str, position: tuple[int, int]) -> None:
    assert parse_event_id(text) == position
    if position[1]:
        assert event_id(*position) == text


@pytest.mark.parametrize("text", ["", "a", "12.", ".3", "1.2.3", "١٢", "12.x", "-1"])
def test_anything_else_is_not_an_event_id(text: str) -> None:
    with pytest.raises(ValueError, match="not an event id"):
        parse_event_id(text)


def test_the_cursor_sends_the_deltas_of_the_call_after_its_last_commit() -> None:
    cursor = Cursor(seq=5)
    earlier = [delta(1, after=3), delta(2, after=4)]  # calls answered by events 4 and 5
    current = [delta(3, after=5), delta(4, after=5)]

    send, behind = cursor.take([*earlier, *current])

    assert (send, behind) == (current, [])
    assert cursor.pos == 4


def test_the_cursor_stops_at_a_delta_that_follows_a_commit_it_has_not_sent() -> None:
    cursor = Cursor(seq=5, pos=2)

    send, rest = cursor.take([delta(3, after=5), delta(4, after=6), delta(5, after=6)])

    assert ([d.pos for d in send], [d.pos for d in rest], cursor.pos) == ([3], [4, 5], 3)
    cursor.committed(6)  # the reader read and sent event 6: the rest are the new call's
    assert cursor.take(rest) == (rest, [])
    assert cursor.pos == 5


def test_before_a_commit_the_calls_last_deltas_go_only_to_a_reader_that_holds_part_of_it() -> None:
    call = [delta(3, after=5), delta(4, after=5)]
    midway = Cursor.resuming(5, 2)  # it had the call's first delta
    fresh = Cursor(5)  # it comes to the call only now, its answer committed

    assert midway.before_commit(call) == (call, [])
    assert fresh.before_commit(call) == ([], [])
    assert fresh.pos == midway.pos == 4
    midway.committed(6)
    assert not midway.open
