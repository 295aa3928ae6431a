"""The Anthropic provider's wire format: cache_control on the stable prefix and the
conversation's last block, thinking blocks sent back first and verbatim, and usage with the
cached tokens counted in the prompt."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from workers.providers.anthropic import (
    caching_on,
    mark_cacheable,
    max_tokens,
    parse_message,
    to_anthropic,
)

EPHEMERAL = {"type": "ephemeral"}
THOUGHT = {"type": "thinking", "thinking": "use the calculator", "signature": "sig-1"}
HIDDEN = {"type": "redacted_thinking", "data": "opaque"}


def _conversation() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "6*7?"},
        {
            "role": "assistant",
            "content": None,
            "thinking": [THOUGHT, HIDDEN],
            "tool_calls": [{"id": "toolu_1", "name": "calculator", "arguments": {"e": "6*7"}}],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "name": "calculator", "content": "42"},
    ]


def test_thinking_goes_back_first_and_as_it_came() -> None:
    _, wire = to_anthropic(_conversation())
    assert wire[1]["content"] == [
        THOUGHT,
        HIDDEN,
        {"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {"e": "6*7"}},
    ]
    assert wire[1]["content"][0] is not THOUGHT  # a copy: marking it never changes the history


def test_the_system_prompt_the_last_tool_and_the_last_block_are_marked() -> None:
    system, wire = to_anthropic(_conversation())
    tools = [{"name": "a"}, {"name": "b"}]
    blocks = mark_cacheable(system, tools, wire)
    assert blocks == [{"type": "text", "text": "Be brief.", "cache_control": EPHEMERAL}]
    assert tools == [{"name": "a"}, {"name": "b", "cache_control": EPHEMERAL}]
    assert wire[-1]["content"][-1]["cache_control"] == EPHEMERAL
    assert wire[0] == {"role": "user", "content": "6*7?"}  # only the last turn is marked


def test_a_text_turn_becomes_a_block_to_carry_the_mark() -> None:
    wire: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    assert mark_cacheable("", [], wire) == ""
    assert wire == [
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": EPHEMERAL}]}
    ]


def test_an_empty_turn_is_left_alone() -> None:
    wire: list[dict[str, Any]] = [{"role": "user", "content": ""}]
    mark_cacheable("", [], wire)
    assert wire == [{"role": "user", "content": ""}]


@pytest.mark.parametrize(
    ("option", "setting", "on"),
    [(None, True, True), (None, False, False), (False, True, False), (True, False, True)],
)
def test_the_task_option_wins_over_the_setting(
    configure: Any, option: bool | None, setting: bool, on: bool
) -> None:
    configure(RATCHET_ANTHROPIC_PROMPT_CACHING=str(setting).lower())
    options = {} if option is None else {"prompt_caching": option}
    assert caching_on(options) is on


def test_usage_counts_the_whole_prompt_and_keeps_the_thinking() -> None:
    reply = anthropic.types.Message.model_validate(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-test",
            "content": [THOUGHT, HIDDEN, {"type": "text", "text": "42"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {
                "input_tokens": 10,
                "output_tokens": 50,
                "cache_read_input_tokens": 1000,
                "cache_creation_input_tokens": 200,
                "output_tokens_details": {"thinking_tokens": 40},
            },
        }
    )
    response = parse_message(reply)
    assert response.content == "42"
    assert (response.input_tokens, response.cached_input_tokens, response.cache_write_tokens) == (
        1210,
        1000,
        200,
    )
    assert (response.output_tokens, response.reasoning_tokens) == (50, 40)
    assert response.thinking == [THOUGHT, HIDDEN]
    assert response.to_dict()["thinking"] == [THOUGHT, HIDDEN]


@pytest.mark.parametrize(
    ("options", "sent"),
    [
        ({}, 4096),
        ({"max_tokens": 1000}, 1000),
        ({"thinking": {"type": "enabled", "budget_tokens": 8000}}, 12096),
        ({"thinking": {"type": "enabled", "budget_tokens": 8000}, "max_tokens": 9000}, 9000),
    ],
)
def test_max_tokens_leaves_room_for_the_thinking_budget(options: dict[str, Any], sent: int) -> None:
    assert max_tokens(options) == sent
