"""A final answer against its task's output schema: judged once, sent back with its error
while tries remain, and the task's result the parsed JSON."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.builders import task_state
from workers.providers.base import ModelResponse, ToolCallRequest
from workers.steps import output

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_an_answer_without_a_schema_is_never_judged() -> None:
    response = ModelResponse(content="not JSON")
    assert output.review(task_state(output_schema=None), response) is response


def test_a_tool_call_is_no_final_answer_to_judge() -> None:
    response = ModelResponse(content="x", tool_calls=[ToolCallRequest("c", "calculator", {})])
    assert output.review(task_state(output_schema=SCHEMA), response) is response


def test_a_missed_schema_is_noted_on_the_answer_and_read_back_as_the_users_reply() -> None:
    reviewed = output.review(task_state(output_schema=SCHEMA), ModelResponse(content='{"n": "1"}'))
    assert reviewed.output_error == "the answer.n: '1' is not of type 'integer'"
    said = reviewed.to_dict()
    assert ModelResponse.from_dict(said) == reviewed
    [feedback] = output.feedback(said)
    assert feedback["role"] == "user"
    assert "the answer.n: '1' is not of type 'integer'" in feedback["content"]
    assert output.feedback(ModelResponse(content="ok").to_dict()) == []


@pytest.mark.parametrize(
    ("limit", "earlier", "fails"), [(2, 0, False), (2, 1, False), (2, 2, True), (0, 0, True)]
)
def test_the_task_fails_once_its_tries_are_used(
    monkeypatch: pytest.MonkeyPatch, limit: int, earlier: int, fails: bool
) -> None:
    from shared.settings import get_settings

    monkeypatch.setenv("RATCHET_OUTPUT_RETRIES", str(limit))
    get_settings.cache_clear()
    try:
        history: list[dict[str, Any]] = []
        for _ in range(earlier):
            history += [
                {"role": "assistant", "content": "x"},
                *output.feedback({"output_error": "bad"}),
            ]
        missed = ModelResponse(content="x", output_error="the answer is not JSON")
        failure = output.failure(missed, history)
        assert (failure is not None) == fails
        assert output.failure(ModelResponse(content="{}"), history) is None
        if failure is not None:
            assert failure.endswith(": the answer is not JSON")
    finally:
        monkeypatch.delenv("RATCHET_OUTPUT_RETRIES")
        get_settings.cache_clear()


def test_the_result_is_the_text_or_the_parsed_json() -> None:
    assert output.result_output(task_state(output_schema=None), None) == ""
    assert output.result_output(task_state(output_schema=None), '{"n": 1}') == '{"n": 1}'
    assert output.result_output(task_state(output_schema=SCHEMA), '{"n": 1}') == {"n": 1}
