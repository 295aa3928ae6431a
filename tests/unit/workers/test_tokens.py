"""Token counts before a model call: tiktoken for OpenAI models, never waiting for the network."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from shared.settings import get_settings
from tests.conftest import Configure
from workers import tokens
from workers.providers.base import ModelRequest, ToolSchema


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(tokens, "_exact", {})
    monkeypatch.setattr(tokens, "_fetchers", {})
    monkeypatch.setattr(tokens, "_counts", {})
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


def test_by_default_an_o200k_model_is_counted_with_cl100k_base_and_nothing_is_fetched() -> None:
    before = threading.active_count()
    assert tokens.encoding_for("openai:gpt-4o-mini") is tokens.bundled()
    assert tokens._fetchers == {}
    assert threading.active_count() == before


def test_counts_are_remembered_by_hash_not_by_text() -> None:
    text = "a long tool output " * 1000
    first = tokens.request_tokens(request(text), "openai:gpt-4", default_output=0)
    assert tokens.request_tokens(request(text), "openai:gpt-4", default_output=0) == first
    assert all(isinstance(key[1], int) for key in tokens._counts)  # the text is not kept


@pytest.fixture
def downloads(configure: Configure) -> None:
    configure(RATCHET_TOKENIZER_DOWNLOADS="true")


@pytest.mark.usefixtures("downloads")
def test_a_hanging_download_never_holds_up_a_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """tiktoken builds an encoding under a lock, and its download has no timeout: a fetch
    stuck there must not stall counting, nor pile up threads."""
    import tiktoken.registry

    release = threading.Event()

    def hanging_fetch(name: str) -> None:
        with tiktoken.registry._lock:  # what a download with no answer does
            release.wait(10)

    monkeypatch.setattr(tokens, "_fetch", hanging_fetch)
    tokens.bundled.cache_clear()  # as in a fresh process: not loaded yet
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, tokens.BUNDLED, raising=False)
    try:
        started = time.perf_counter()
        assert tokens.encoding_for("openai:gpt-4o") is tokens.bundled()
        assert time.perf_counter() - started < 5  # loading it, not waiting for the download
        started = time.perf_counter()
        for _ in range(3):
            assert tokens.encoding_for("openai:gpt-4o-mini") is tokens.bundled()
            tokens.request_tokens(request("hello there"), "openai:gpt-4o", default_output=1)
        assert time.perf_counter() - started < 0.5
        monkeypatch.setattr(tokens, "RETRY_FETCH_SECONDS", 0.0)
        tokens.encoding_for("openai:gpt-4o")  # the retry window is over, but it still hangs
        fetchers = [t for t in threading.enumerate() if t.name == "tiktoken-o200k_base"]
        assert len(fetchers) == 1
    finally:
        release.set()


@pytest.mark.usefixtures("downloads")
def test_an_o200k_model_is_counted_with_its_own_encoding_once_loaded() -> None:
    """The first count answers at once with cl100k_base; the model's own encoding is loaded
    (once) in the background, and counts once it is there. On a host that cannot reach
    OpenAI's file server the load fails and cl100k_base goes on counting."""
    started = time.perf_counter()
    assert tokens.encoding_for("openai:gpt-4o-mini") is tokens.bundled()
    assert time.perf_counter() - started < 0.5
    assert set(tokens._fetchers) == {"o200k_base"}
    fetcher = tokens._fetchers["o200k_base"][1]
    tokens.encoding_for("openai:gpt-4o")  # the same encoding: no second fetch
    assert tokens._fetchers["o200k_base"][1] is fetcher
    fetcher.join(timeout=60)
    after = tokens.encoding_for("openai:gpt-4o-mini")
    assert after is not None
    if "o200k_base" in tokens._exact:
        assert after.name == "o200k_base"
    else:
        assert after is tokens.bundled()
