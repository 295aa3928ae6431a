"""A model's context window (an operator's setting, else the table of known models, else the
default) and a task's context policy, as stored and with the room it keeps for the answer."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from shared.context_window import (
    ContextPolicy,
    Policy,
    answer_room,
    context_window,
    policy_of,
)
from shared.settings import Settings, describe_invalid


def settings(**values: Any) -> Settings:
    return Settings(_env_file=None, **values)


@pytest.mark.parametrize(
    ("model", "window"),
    [
        ("openai:gpt-4o", 128_000),
        ("openai:gpt-4o-mini-2024-07-18", 128_000),  # the longest known prefix: gpt-4o
        ("openai:gpt-4.1-nano", 1_047_576),
        ("openai:gpt-4-0613", 8_192),
        ("openai:gpt-4-turbo-2024-04-09", 128_000),
        ("anthropic:claude-sonnet-4-5", 200_000),
        ("openai:llama-3.1-8b-instruct", 32_768),  # unknown: the default
        ("scripted", 32_768),
    ],
)
def test_known_models_have_their_published_window(model: str, window: int) -> None:
    assert context_window(model, settings()) == window


def test_an_operator_setting_wins_and_unknown_models_take_the_default() -> None:
    configured = settings(
        model_context_windows={"openai:gpt-4o": 64_000, "openai:my-model": 8_192},
        default_context_window=16_384,
    )
    assert context_window("openai:gpt-4o", configured) == 64_000
    assert context_window("openai:my-model", configured) == 8_192
    assert context_window("openai:other", configured) == 16_384


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ('{"gpt-4o": 8192}', "unknown model provider 'gpt-4o'"),
        ('{"openai:tiny": 100}', "at least 1024 tokens"),
        ('{"openai:x": "big"}', "RATCHET_MODEL_CONTEXT_WINDOWS"),
        ("not json", "model_context_windows"),
    ],
)
def test_a_bad_window_setting_stops_the_process_with_one_line(
    raw: str, problem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pydantic_settings import SettingsError

    monkeypatch.setenv("RATCHET_MODEL_CONTEXT_WINDOWS", raw)
    with pytest.raises((ValidationError, SettingsError)) as caught:
        settings()
    assert isinstance(caught.value, ValidationError | SettingsError)
    line = describe_invalid(caught.value)
    assert problem in line
    assert "\n" not in line


def test_the_stored_policy_is_read_back_and_none_is_the_servers_default() -> None:
    assert policy_of(None, settings(context_policy="summarize")) == ContextPolicy(Policy.SUMMARIZE)
    stored = ContextPolicy(Policy.TRUNCATE, "openai:gpt-4o-mini", 500).as_json()
    assert stored == {"policy": "truncate", "model": "openai:gpt-4o-mini", "reserve_tokens": 500}
    assert policy_of(stored, settings()) == ContextPolicy(
        Policy.TRUNCATE, "openai:gpt-4o-mini", 500
    )
    assert ContextPolicy(Policy.OFF).as_json() == {"policy": "off"}


@pytest.mark.parametrize(
    ("reserve", "options", "window", "room"),
    [
        (700, {"max_tokens": 50}, 8_000, 700),  # the policy's reserve first
        (None, {"max_tokens": 50}, 8_000, 50),  # then the call's own limit
        (None, {"max_completion_tokens": 60}, 8_000, 60),
        (None, {}, 128_000, 4_096),  # then the setting
        (None, {}, 4_000, 1_000),  # at most a quarter of the window
        (None, {"thinking": {"type": "enabled", "budget_tokens": 8_000}}, 200_000, 12_096),
    ],
)
def test_the_room_kept_for_the_answer(
    reserve: int | None, options: dict[str, Any], window: int, room: int
) -> None:
    policy = ContextPolicy(Policy.TRUNCATE, reserve_tokens=reserve)
    assert answer_room(policy, options, window=window, settings=settings()) == room


@pytest.mark.parametrize(
    ("context", "problem"),
    [
        ({"policy": "squash"}, "policy must be truncate, summarize or off"),
        ({"keep": 3}, "unknown keys ['keep']"),
        ({"model": "gpt-4o"}, "unknown model provider 'gpt-4o'"),
        ({"reserve_tokens": 0}, "reserve_tokens must be a positive integer"),
    ],
)
def test_an_agent_with_a_bad_policy_is_refused_when_registered(
    context: dict[str, Any], problem: str
) -> None:
    from shared.agents.registry import Agent, register_agent

    with pytest.raises(ValueError, match="agent 'bad': context: ") as caught:
        register_agent(Agent("bad", context=context))
    assert problem in str(caught.value)


def test_an_agent_with_a_policy_is_registered() -> None:
    from shared.agents.registry import Agent, get_registry, register_agent

    register_agent(Agent("careful-reader", context={"policy": "summarize"}))
    try:
        assert get_registry().agents["careful-reader"].context == {"policy": "summarize"}
    finally:
        del get_registry().agents["careful-reader"]
