"""The conversation sent to the model: rebuilt from the task's input, its agent's instructions
and its committed steps, or carried over in memory from the step before on the same thread.

Both ways must give the model the same messages, and every tool result must follow the
assistant message that asked for it, under that call's id.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.agents.registry import Agent
from shared.store import ledger
from shared.store.ledger import CallStatus
from shared.store.tables import Step, ToolCall
from tests.unit.builders import lease_on, task_state
from workers.providers.base import ModelResponse, ToolCallRequest, parse_arguments
from workers.steps.context import Context, open_conversation, read_back, step_messages
from workers.tool_runner import Outcome, message_content

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=6,
)
ARGUMENTS = st.dictionaries(st.text(max_size=6), JSON, max_size=3)


# --- the opening: system prompt, instructions, input ---------------------------------------------


@pytest.mark.parametrize(
    ("system_prompt", "instructions", "expected"),
    [
        ("You are terse.", "Answer in French.", "You are terse.\n\nAnswer in French."),
        ("You are terse.", None, "You are terse."),
        ("", "Answer in French.", "Answer in French."),
    ],
)
def test_the_system_message_is_the_agent_prompt_then_the_task_instructions(
    system_prompt: str, instructions: str | None, expected: str
) -> None:
    task = task_state(input="hi", instructions=instructions)
    messages = open_conversation(task, Agent("a", system_prompt=system_prompt))
    assert messages == [
        {"role": "system", "content": expected},
        {"role": "user", "content": "hi"},
    ]


def test_without_prompt_or_instructions_there_is_no_system_message() -> None:
    messages = open_conversation(task_state(input="hi", instructions=""), Agent("a"))
    assert messages == [{"role": "user", "content": "hi"}]


def test_a_conversation_given_as_input_is_kept_in_order_with_only_role_and_content() -> None:
    given_input = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ]
    messages = open_conversation(task_state(input=given_input), Agent("a"))
    assert messages == [{"role": m["role"], "content": m["content"]} for m in given_input]


# --- what a tool call's outcome reads as ---------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "content"),
    [
        (Outcome(ok=True, result="plain text"), "plain text"),
        (Outcome(ok=True, result={"sum": 3}), '{"sum": 3}'),
        (Outcome(ok=True, result=None), "null"),
        (Outcome(ok=False, result={"ignored": True}, error="boom"), "error: boom"),
    ],
)
def test_the_model_reads_a_text_result_as_is_any_other_as_json_and_an_error_as_such(
    outcome: Outcome, content: str
) -> None:
    assert message_content(ok=outcome.ok, result=outcome.result, error=outcome.error) == content


@given(arguments=ARGUMENTS)
def test_tool_arguments_that_are_a_json_object_decode_to_it(arguments: dict[str, Any]) -> None:
    assert parse_arguments(json.dumps(arguments)) == (arguments, None)


@pytest.mark.parametrize("raw", ["{", "[1, 2]", '"text"', "3", "null"])
def test_tool_arguments_that_are_no_json_object_are_kept_raw_for_the_error(raw: str) -> None:
    assert parse_arguments(raw) == ({}, raw)


def test_absent_tool_arguments_are_an_empty_object() -> None:
    assert parse_arguments(None) == parse_arguments("") == ({}, None)


# --- a step's answer, as stored and as replayed --------------------------------------------------

CALLS = st.lists(
    st.builds(
        ToolCallRequest,
        id=st.text(min_size=1, max_size=8),
        name=st.sampled_from(["calculator", "http_request", "search"]),
        arguments=ARGUMENTS,
        invalid_arguments=st.none() | st.text(min_size=1, max_size=8),
    ),
    max_size=4,
)
RESPONSES = st.builds(ModelResponse, content=st.none() | st.text(max_size=20), tool_calls=CALLS)


@given(response=RESPONSES)
def test_a_stored_response_replays_as_the_response_the_model_gave(response: ModelResponse) -> None:
    stored = json.loads(json.dumps(response.to_dict()))  # as a JSON column hands it back
    assert ModelResponse.from_dict(stored) == response


# --- rebuilding the history from committed rows --------------------------------------------------


def step_row(number: int, response: ModelResponse) -> Step:
    return Step(number=number, response=response.to_dict())


def call_row(step: int, position: int, call: ToolCallRequest, outcome: Outcome) -> ToolCall:
    """The ledger row of a finished call, as the step writes it."""
    return ToolCall(
        step_number=step,
        position=position,
        call_id=ledger.call_id(step, position),
        provider_call_id=call.id,
        tool=call.name,
        arguments=call.arguments,
        status=CallStatus.SUCCEEDED if outcome.ok else CallStatus.FAILED,
        result=outcome.result,
        error=outcome.error,
    )


OUTCOMES = st.builds(
    Outcome, ok=st.booleans(), result=JSON, error=st.none() | st.text(min_size=1, max_size=10)
)


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[Step], list[ToolCall]]:
    """Committed steps 1..n, each with the ledger rows of its calls (in position order)."""
    steps, calls = [], []
    for number in range(1, draw(st.integers(1, 4)) + 1):
        response = draw(RESPONSES)
        steps.append(step_row(number, response))
        calls += [
            call_row(number, position, call, draw(OUTCOMES))
            for position, call in enumerate(response.tool_calls)
        ]
    return steps, calls


@given(history=histories())
def test_every_tool_result_follows_the_answer_that_asked_for_it_under_its_call_id(
    history: tuple[list[Step], list[ToolCall]],
) -> None:
    steps, calls = history
    messages = step_messages(steps, calls)

    assistants = [m for m in messages if m["role"] == "assistant"]
    assert [m["tool_calls"] for m in assistants] == [s.response["tool_calls"] for s in steps]
    asked: list[tuple[str, str]] = []
    for message in messages:
        if message["role"] == "assistant":
            assert asked == [], "a call of the answer before went unanswered"
            asked = [(c["id"], c["name"]) for c in message["tool_calls"]]
        else:
            assert message["role"] == "tool"
            assert (message["tool_call_id"], message["name"]) == asked.pop(0)
    assert asked == []


def test_the_history_leaves_out_the_calls_of_a_step_that_is_not_committed() -> None:
    first = ModelResponse("", [ToolCallRequest("p1", "calculator", {"x": 1})])
    current = ModelResponse("", [ToolCallRequest("p2", "calculator", {"x": 2})])
    calls = [
        call_row(1, 0, first.tool_calls[0], Outcome(ok=True, result=1)),
        call_row(2, 0, current.tool_calls[0], Outcome(ok=True, result=2)),
    ]
    messages = step_messages([step_row(1, first)], calls)
    assert [m.get("tool_call_id") for m in messages] == [None, "p1"]


# --- carried over in memory: the same messages as rebuilt from the rows --------------------------


@given(
    response=RESPONSES,
    outcomes=st.lists(st.tuples(OUTCOMES, st.booleans()), min_size=4, max_size=4),
    step=st.integers(1, 50),
)
def test_a_step_carried_over_in_memory_reads_as_its_rows_would_rebuild_it(
    response: ModelResponse, outcomes: list[tuple[Outcome, bool]], step: int
) -> None:
    """What this lease recorded comes from memory, what an earlier lease of the step recorded
    from its ledger row: either way the next step sees what a fresh read would give it."""
    task = task_state(steps=step - 1)
    rows = [
        call_row(step, position, call, outcomes[position][0])
        for position, call in enumerate(response.tool_calls)
    ]
    in_memory = {row.call_id for row, (_, mine) in zip(rows, outcomes, strict=False) if mine}
    ctx = Context(
        lease=lease_on(task),
        task=task,
        agent=Agent("a"),
        tools={},
        history=[],
        step_row=None,
        calls={row.call_id: row for row in rows if row.call_id not in in_memory},
        tenant_name="tenant",
        clock_ms=0,
        outcomes={
            row.call_id: outcome
            for row, (outcome, _) in zip(rows, outcomes, strict=False)
            if row.call_id in in_memory
        },
    )

    assert read_back(ctx, response) == step_messages([step_row(step, response)], rows)
