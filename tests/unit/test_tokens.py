"""Token counts before a model call: tiktoken for OpenAI models, never waiting for the network."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from shared.settings import get_settings
from workers import tokens
from workers.models.base import ModelRequest, ToolSchema


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(tokens, "_exact", {})
    monkeypatch.setattr(tokens, "_fetching", {})
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def request(
    *contents: str, tools: list[ToolSchema] | None = None, **options: object
) -> ModelRequest:
    return ModelRequest(
        task_id="t",
        step=1,
        model="",
        messages=[{"role": "user", "content": c} for c in contents],
        tools=tools or [],
        options=dict(options),
    )


def test_the_bundled_encoding_is_cl100k_base() -> None:
    # Token ids published for cl100k_base: the file is the real one (tiktoken checks its hash).
    assert tokens.bundled().encode_ordinary("hello world") == [15339, 1917]


def test_openai_models_are_counted_with_tiktoken() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 20
    exact = len(tokens.bundled().encode_ordinary(text))
    assert exact != (len(text) + 3) // 4  # the two ways of counting differ here
    counted = tokens.request_tokens(
        request(text, "hi", max_tokens=100), "openai:gpt-4", default_output=512
    )
    chat_format = 2 * tokens.PER_MESSAGE + tokens.REPLY_PRIMING
    assert counted == exact + 1 + chat_format + 100
    # special-token text in a user's message is only text
    assert (
        tokens.request_tokens(request("<|endoftext|>"), "openai:gpt-4", default_output=0)
        > 1 + chat_format
    )


def test_tools_and_the_default_answer_size_are_counted() -> None:
    tool = ToolSchema("lookup", "find a thing", {"type": "object", "properties": {}})
    without = tokens.request_tokens(request("hi"), "openai:gpt-4", default_output=512)
    with_tool = tokens.request_tokens(
        request("hi", tools=[tool]), "openai:gpt-4", default_output=512
    )
    assert with_tool > without > 512
    assert (
        tokens.request_tokens(
            request("hi", max_completion_tokens=7), "openai:gpt-4", default_output=512
        )
        < 20
    )


def test_other_providers_are_counted_at_four_characters_a_token() -> None:
    text = "x" * 400
    assert tokens.encoding_for("anthropic:claude-sonnet-4-5") is None
    assert (
        tokens.request_tokens(request(text), "anthropic:claude-sonnet-4-5", default_output=50)
        == 100 + 50
    )
    assert tokens.request_tokens(request(text), "scripted:default", default_output=50) == 100 + 50


def test_an_unknown_model_behind_an_openai_server_is_counted_with_cl100k_base() -> None:
    assert tokens.encoding_for("openai:my-local-llama") is tokens.bundled()


def test_with_downloads_off_an_o200k_model_is_counted_with_cl100k_base(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RATCHET_TOKENIZER_DOWNLOADS", "false")
    before = threading.active_count()
    assert tokens.encoding_for("openai:gpt-4o-mini") is tokens.bundled()
    assert tokens._fetching == {}
    assert threading.active_count() == before


def test_an_o200k_model_never_waits_for_its_encoding() -> None:
    """The first count answers at once with cl100k_base; the model's own encoding is fetched
    (once per retry window) in the background, and counts once it is there. On a host that
    cannot reach OpenAI's file server the fetch fails and cl100k_base goes on counting."""
    started = time.perf_counter()
    assert tokens.encoding_for("openai:gpt-4o-mini") is tokens.bundled()
    assert time.perf_counter() - started < 0.5
    assert set(tokens._fetching) == {"o200k_base"}
    fetchers = [t for t in threading.enumerate() if t.name == "tiktoken-o200k_base"]
    assert len(fetchers) == 1
    tokens.encoding_for("openai:gpt-4o")  # the same encoding: no second fetch
    assert len([t for t in threading.enumerate() if t.name == "tiktoken-o200k_base"]) <= 1
    fetchers[0].join(timeout=60)
    after = tokens.encoding_for("openai:gpt-4o-mini")
    assert after is not None
    if "o200k_base" in tokens._exact:
        assert after.name == "o200k_base"
    else:
        assert after is tokens.bundled()
