"""The scripted model: turn n answers call n, error turns fail as told, with no services."""

from __future__ import annotations

import pytest

from shared.errors import ModelRateLimited, ModelTransientError
from workers.providers.base import ModelRequest
from workers.providers.scripted import ScriptedProvider


def request(
    script: list[dict[str, object]], step: int, messages: list[dict[str, object]] | None = None
) -> ModelRequest:
    return ModelRequest(
        task_id="t",
        step=step,
        model="",
        messages=messages or [{"role": "user", "content": "hi"}],
        tools=[],
        options={"script": script},
    )


def test_turn_n_answers_call_n() -> None:
    script = [
        {"tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]},
        {"content": "The answer is 42.", "usage": {"input_tokens": 10, "output_tokens": 5}},
    ]
    provider = ScriptedProvider()
    first = provider.complete(request(script, 1))
    assert first.content is None
    assert [(c.name, c.arguments) for c in first.tool_calls] == [
        ("calculator", {"expression": "6*7"})
    ]
    second = provider.complete(request(script, 2))
    assert (second.content, second.input_tokens, second.output_tokens) == (
        "The answer is 42.",
        10,
        5,
    )


def test_past_the_end_answers_with_the_last_tool_result() -> None:
    messages = [
        {"role": "user", "content": "x"},
        {"role": "tool", "tool_call_id": "a", "content": "42"},
    ]
    assert ScriptedProvider().complete(request([], 1, messages)).content == "42"


@pytest.mark.parametrize(
    ("error", "exc"),
    [
        ("rate_limit", ModelRateLimited),
        ("server_error", ModelTransientError),
        ("timeout", ModelTransientError),
    ],
)
def test_error_turns_fail_n_times_then_answer(error: str, exc: type[Exception]) -> None:
    provider = ScriptedProvider()
    script = [{"error": error, "times": 2, "content": "ok"}]
    for _ in range(2):
        with pytest.raises(exc):
            provider.complete(request(script, 1))
    assert provider.complete(request(script, 1)).content == "ok"


def test_a_summary_is_written_from_what_it_was_given_whatever_the_script() -> None:
    from dataclasses import replace

    transcript = "[step 1] assistant called read_page({})\n" + "word " * 500
    asked = replace(
        request([{"content": "a step's answer"}], 3, [{"role": "user", "content": transcript}]),
        purpose="summary",
    )
    first, again = ScriptedProvider().complete(asked), ScriptedProvider().complete(asked)
    assert first == again  # the same prompt, the same summary
    assert first.content is not None
    assert first.content.startswith("Scripted summary: [step 1] assistant called read_page")
    assert len(first.content) < 500
    assert not first.tool_calls
    assert first.output_tokens > 0
