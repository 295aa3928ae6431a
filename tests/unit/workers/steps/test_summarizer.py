"""What the summarize policy compresses and how the summarizing model is shown it: the oldest
turns, the newest kept verbatim in half the budget; the turns as a transcript, no more of them
than the summarizing model's window takes."""

from __future__ import annotations

from workers.providers.base import Message, estimate_tokens
from workers.steps import summarizer
from workers.steps.window import Counter

ESTIMATE = Counter("scripted", estimate_tokens, exact=False)


def turn(step: int, chars: int = 400) -> list[Message]:
    call = {"id": f"call_{step}", "name": "read_page", "arguments": {"number": step}}
    return [
        {"role": "assistant", "content": "Reading on.", "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": f"call_{step}",
            "name": "read_page",
            "content": "x" * chars,
        },
    ]


def test_the_oldest_turns_are_compressed_and_the_newest_kept_in_half_the_budget() -> None:
    turns = [turn(step) for step in range(1, 21)]
    size = ESTIMATE.messages(turns[0])
    count = summarizer._turns_to_compress(turns, budget=size * 10, counter=ESTIMATE)
    assert count == 15  # five turns fill half of a budget of ten
    assert summarizer._turns_to_compress(turns[:2], budget=10, counter=ESTIMATE) == 1


def test_the_transcript_names_each_step_and_stops_where_the_window_does() -> None:
    turns = [turn(step, chars=40) for step in range(5, 15)]
    text, last = summarizer._transcript(turns, first_step=5, room=10_000, counter=ESTIMATE)
    assert last == 14
    assert text.splitlines()[:3] == [
        "[step 5] assistant: Reading on.",
        '[step 5] assistant called read_page({"number": 5})',
        "[step 5] result of read_page: " + "x" * 40,
    ]
    one = ESTIMATE.count_text(summarizer._render(turns[0], step=5))
    text, last = summarizer._transcript(turns, first_step=5, room=one * 3, counter=ESTIMATE)
    assert last == 7


def test_a_first_turn_too_long_for_the_summarizer_is_cut_short() -> None:
    text, last = summarizer._transcript(
        [turn(1, chars=50_000)], first_step=1, room=500, counter=ESTIMATE
    )
    assert last == 1
    assert "characters cut out here" in text
    assert ESTIMATE.count_text(text) < 700


def test_the_prompt_builds_on_the_summary_before() -> None:
    first = summarizer._prompt("Read the book.", "", "t", first=1, last=9, room=1000)
    later = summarizer._prompt("Read the book.", "pages 1-9", "t", first=10, last=20, room=1000)
    assert first[0]["content"].startswith(summarizer.INSTRUCTIONS[:12])
    assert "summary so far" not in first[1]["content"]
    assert "The summary so far (of step 1 to step 9):\npages 1-9" in later[1]["content"]
    assert later[1]["content"].endswith("of everything through step 20.")
