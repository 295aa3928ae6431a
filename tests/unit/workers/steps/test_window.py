"""The prompt's size and the cut that keeps it inside the window: the system prompt and the
first user message always stay, then the newest turns that fit, each whole (a tool call never
without its result), after a marker that says what was left out."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.providers.base import Message, ToolSchema, estimate_tokens
from workers.steps import window
from workers.steps.window import Counter, TooLong, split, summary_message, truncate

ESTIMATE = Counter("scripted", estimate_tokens, exact=False)
OPENING: list[Message] = [
    {"role": "system", "content": "You read."},
    {"role": "user", "content": "Read the book."},
]


def turn(step: int, *, result_chars: int = 400, calls: int = 1) -> list[Message]:
    asked = [
        {"id": f"call_{step}_{i}", "name": "read_page", "arguments": {"number": step}}
        for i in range(calls)
    ]
    results = [
        {
            "role": "tool",
            "tool_call_id": c["id"],
            "name": "read_page",
            "content": "x" * result_chars,
        }
        for c in asked
    ]
    return [{"role": "assistant", "content": None, "tool_calls": asked}, *results]


def history(steps: int, **shape: Any) -> list[Message]:
    return OPENING + [m for step in range(1, steps + 1) for m in turn(step, **shape)]


def paired(messages: list[Message]) -> bool:
    """Every tool result right after the answer that asked for it, and every call answered."""
    open_calls: set[str] = set()
    for message in messages:
        if message["role"] == "tool":
            if message["tool_call_id"] not in open_calls:
                return False
            open_calls.discard(message["tool_call_id"])
        elif open_calls:
            return False
        else:
            open_calls = {c["id"] for c in message.get("tool_calls") or ()}
    return not open_calls


def test_a_turn_is_an_answer_and_what_followed_it() -> None:
    extra_input: Message = {"role": "assistant", "content": "an earlier reply, given as input"}
    messages = [*OPENING, extra_input, *turn(1, calls=2), *turn(2)]
    conversation = split(messages, opening=3)
    assert conversation.head == OPENING
    assert conversation.units[0] == [extra_input]
    assert conversation.turns == [turn(1, calls=2), turn(2)]
    assert conversation.first_step == 1


def test_a_summary_joins_the_head_and_the_turns_after_it_count_from_its_step() -> None:
    summary = summary_message(number=2, through_step=30, content="pages 1 to 30 read")
    conversation = split([*OPENING, summary, *turn(31)], opening=2)
    assert conversation.head == [*OPENING, summary]
    assert conversation.turns == [turn(31)]
    assert conversation.first_step == 31
    assert "through step 30" in summary["content"]


@given(
    steps=st.integers(1, 60),
    calls=st.integers(1, 3),
    result_chars=st.integers(0, 3_000),
    budget=st.integers(400, 6_000),
)
def test_the_cut_fits_keeps_the_head_and_the_newest_turns_whole(
    steps: int, calls: int, result_chars: int, budget: int
) -> None:
    conversation = split(history(steps, calls=calls, result_chars=result_chars), opening=2)
    try:
        cut = truncate(conversation, budget=budget, counter=ESTIMATE)
    except TooLong:
        return  # the newest answer alone does not fit: the step fails, nothing is sent
    assert cut.tokens == ESTIMATE.messages(cut.messages) <= budget
    assert cut.messages[:2] == OPENING
    assert paired(cut.messages[2 + bool(cut.dropped) :])
    if cut.dropped:
        assert "left out here" in cut.messages[2]["content"]
        kept = cut.messages[3:]
        newest = [m for t in conversation.turns[cut.dropped :] for m in t]
        if len(kept) == len(newest):  # whole turns: exactly the newest ones
            assert [m["role"] for m in kept] == [m["role"] for m in newest]


def test_the_marker_names_what_was_left_out() -> None:
    conversation = split(history(10), opening=2)
    marker = 40  # about the marker's tokens
    cut = truncate(conversation, budget=ESTIMATE.messages(history(3)) + marker, counter=ESTIMATE)
    assert cut.dropped == 7
    assert cut.messages[2] == {
        "role": "user",
        "content": "[14 earlier messages (the turns of step 1 to step 7) left out here to fit "
        "the model's context window]",
    }
    assert cut.messages[3:] == turn(8) + turn(9) + turn(10)


def test_a_newest_turn_too_large_alone_has_its_results_cut_short() -> None:
    conversation = split(history(2, result_chars=40_000), opening=2)
    cut = truncate(conversation, budget=2_000, counter=ESTIMATE)
    assert cut.tokens <= 2_000
    result = cut.messages[-1]["content"]
    assert "characters cut out here" in result
    assert cut.messages[-2]["tool_calls"] == turn(2)[0]["tool_calls"]


def test_a_head_larger_than_the_window_cannot_be_sent() -> None:
    huge = [{"role": "system", "content": "x" * 40_000}, {"role": "user", "content": "hi"}]
    with pytest.raises(TooLong):
        truncate(split(huge, opening=2), budget=1_000, counter=ESTIMATE)


def test_tool_calls_thinking_and_definitions_are_counted_as_sent() -> None:
    answer = turn(1)[0]
    bare = {"role": "assistant", "content": None}
    assert ESTIMATE.message(answer) > ESTIMATE.message(bare) + 10
    thinking = [{"type": "thinking", "thinking": "x" * 4_000, "signature": "s"}]
    assert ESTIMATE.message(bare | {"thinking": thinking}) > ESTIMATE.message(bare) + 1_000
    schema = ToolSchema("read_page", "Read a page.", {"type": "object", "properties": {}})
    assert ESTIMATE.tools([schema]) >= estimate_tokens("read_pageRead a page.")


def test_openai_models_are_counted_with_their_tokenizer() -> None:
    counter = window.counter_for("openai:gpt-4o-mini")
    assert counter.exact
    assert counter.count_text("hello world") == 2
    assert not window.counter_for("anthropic:claude-sonnet-4-5").exact


def test_estimates_are_raised_by_what_the_provider_reports_and_never_lowered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(window, "_ratios", {})
    model = "anthropic:claude-sonnet-4-5"
    counter = window.counter_for(model)
    messages: list[Message] = [{"role": "user", "content": "x" * 4_000}]
    first = counter.messages(messages)
    window.observe(model, counted=first, reported=first * 2)
    assert counter.messages(messages) >= first * 2 - 1
    window.observe(model, counted=counter.messages(messages), reported=first // 2)
    assert first < counter.messages(messages) < first * 2  # down slowly, never below 1:1
    for _ in range(50):
        window.observe(model, counted=counter.messages(messages), reported=1)
    assert counter.messages(messages) >= first
    window.observe("openai:gpt-4o", counted=100, reported=1_000)  # a tokenizer's: not corrected
    assert "openai:gpt-4o" not in window._ratios


def test_a_conversation_carried_on_is_counted_from_where_its_count_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counted: list[Message] = []

    def counting(self: Counter, message: Message) -> int:
        counted.append(message)
        return 10

    monkeypatch.setattr(Counter, "message", counting)
    before = history(3)
    assert ESTIMATE.history("t1", before) == ESTIMATE.messages(before)
    counted.clear()
    carried = [*before, *turn(4)]  # the same objects, then the next step's
    assert ESTIMATE.history("t1", carried) == 10 * len(carried) + 3
    assert counted == turn(4)
    counted.clear()
    reread = [dict(m) for m in carried]  # read back from the store: new objects, all counted
    assert ESTIMATE.history("t1", reread) == 10 * len(carried) + 3
    assert len(counted) == len(carried)
    counted.clear()
    summarized = [*carried[:2], summary_message(number=1, through_step=3, content="s"), *turn(4)]
    assert ESTIMATE.history("t1", summarized) == 10 * len(summarized) + 3
    assert len(counted) == len(summarized)
