"""The providers' streaming calls against the test servers on real HTTP: a streamed answer is
the same ``ModelResponse`` as the whole answer asked for at once (text, tool calls, thinking
blocks, usage and its details), its pieces concatenate to it, and an error sent mid-stream
is sorted as the same error answered with its HTTP status."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from shared.errors import ModelPermanentError, ModelRateLimited, ModelTransientError
from tests.conftest import Configure
from tests.fakes.anthropic_server import (
    MessagesServer,
    message,
    redacted_thinking,
    stream_error,
    text,
    thinking,
    tool_use,
)
from tests.fakes.openai_server import Call, Completion, OpenAIServer
from workers.providers.base import ModelRequest, ModelResponse, ToolSchema


@dataclass
class Recorder:
    """A ``Deltas`` that keeps every piece it is handed."""

    text_pieces: list[str] = field(default_factory=list)
    call_pieces: dict[int, dict[str, Any]] = field(default_factory=dict)

    def text(self, delta: str) -> None:
        self.text_pieces.append(delta)

    def tool_call(self, index: int, *, call_id: str, name: str, arguments: str) -> None:
        call = self.call_pieces.setdefault(index, {"id": "", "name": "", "arguments": ""})
        call["id"] += call_id
        call["name"] += name
        call["arguments"] += arguments

    @contextmanager
    def stopping(self, stop: Callable[[], None]) -> Iterator[None]:
        yield

    @property
    def stopped(self) -> bool:
        return False


CALCULATOR = ToolSchema("calculator", "Evaluate", {"type": "object", "properties": {}})


def request(model: str, **options: Any) -> ModelRequest:
    return ModelRequest(
        task_id="t-1",
        step=1,
        model=model,
        messages=[{"role": "user", "content": "What is 6*7?"}],
        tools=[CALCULATOR],
        options=options,
    )


def both_ways(complete: Callable[[ModelRequest], ModelResponse], asked: ModelRequest) -> Any:
    """The answer asked for whole, then streamed (the server gives the same reply twice),
    and the pieces the stream handed over."""
    whole = complete(asked)
    recorder = Recorder()
    streamed = complete(replace(asked, deltas=recorder))
    return whole, streamed, recorder


@pytest.fixture
def openai(openai_server: OpenAIServer, configure: Configure) -> Any:
    configure(RATCHET_OPENAI_BASE_URL=openai_server.base_url, RATCHET_OPENAI_API_KEY="test-key")
    from workers.providers.openai import OpenAIProvider

    return openai_server, OpenAIProvider()


@pytest.mark.parametrize(
    "reply",
    [
        Completion(content="The answer is 42.", cached_tokens=5, reasoning_tokens=3),
        Completion(
            content="Let me work it out.",
            calls=(
                Call("calculator", {"expression": "6*7"}, id="call_a"),
                Call("calculator", {"expression": "6*8"}, id="call_b"),
            ),
            chunks=4,
        ),
        Completion(calls=(Call("calculator", "{not json", id="call_bad"),)),
    ],
    ids=["text", "text_and_two_calls", "malformed_arguments"],
)
def test_an_openai_stream_is_the_same_answer_as_the_whole_completion(
    openai: Any, reply: Completion
) -> None:
    server, provider = openai
    server.reply(reply, reply)

    whole, streamed, recorder = both_ways(provider.complete, request("gpt-4o-mini"))

    assert streamed == whole
    assert "".join(recorder.text_pieces) == (whole.content or "")
    for index, call in enumerate(whole.tool_calls):
        piece = recorder.call_pieces[index]
        assert (piece["id"], piece["name"]) == (call.id, call.name)
    plain, streamed_body = (r.body for r in server.requests)
    assert "stream" not in plain
    assert streamed_body["stream"] is True


def test_a_server_that_ignores_stream_is_read_whole(configure: Configure) -> None:
    from workers.providers.openai import OpenAIProvider

    with OpenAIServer(streams=False) as server:
        configure(RATCHET_OPENAI_BASE_URL=server.base_url, RATCHET_OPENAI_API_KEY="test-key")
        server.reply(Completion(content="The answer is 42."))

        said = OpenAIProvider().complete(replace(request("gpt-4o-mini"), deltas=Recorder()))

    assert said.content == "The answer is 42."
    assert server.requests[0].body["stream"] is True


@pytest.fixture
def anthropic(configure: Configure) -> Iterator[Callable[..., Any]]:
    servers: list[MessagesServer] = []

    def start(*replies: dict[str, Any]) -> Any:
        server = MessagesServer([(200, reply) for reply in replies])
        servers.append(server)
        configure(RATCHET_ANTHROPIC_BASE_URL=server.url, RATCHET_ANTHROPIC_API_KEY="test-key")
        from workers.providers.anthropic import AnthropicProvider

        return server, AnthropicProvider()

    yield start
    for server in servers:
        server.close()


ANTHROPIC_REPLIES = {
    "text": message([text("The answer is 42, as it happens.")], "end_turn", tokens=(30, 9)),
    "thinking_and_calls": message(
        [
            thinking("Six sevens are forty-two, I should check.", "sig-abc"),
            redacted_thinking("opaque"),
            text("Checking."),
            tool_use("calculator", {"expression": "6*7"}, "toolu_1"),
            tool_use("calculator", {"expression": "6*8"}, "toolu_2"),
        ],
        "tool_use",
        tokens=(40, 30),
        cache_read=100,
        cache_write=20,
        thinking_tokens=12,
    ),
}


@pytest.mark.parametrize("name", list(ANTHROPIC_REPLIES))
def test_an_anthropic_stream_is_the_same_answer_as_the_whole_message(
    anthropic: Callable[..., Any], name: str
) -> None:
    reply = ANTHROPIC_REPLIES[name]
    server, provider = anthropic(reply, reply)

    whole, streamed, recorder = both_ways(provider.complete, request("claude-test"))

    assert streamed == whole
    assert "".join(recorder.text_pieces) == (whole.content or "")
    for index, call in enumerate(whole.tool_calls):
        piece = recorder.call_pieces[index]
        assert (piece["id"], piece["name"]) == (call.id, call.name)
        assert piece["arguments"]  # the input came in pieces, as JSON text
    assert [r["body"].get("stream") for r in server.requests] == [None, True]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("overloaded_error", ModelTransientError),
        ("api_error", ModelTransientError),
        ("rate_limit_error", ModelRateLimited),
        ("invalid_request_error", ModelPermanentError),
    ],
)
def test_an_anthropic_error_mid_stream_maps_as_its_status_would(
    anthropic: Callable[..., Any], kind: str, expected: type[Exception]
) -> None:
    reply = message([text("Half an answ"), text("er")], "end_turn", tokens=(30, 9))
    _, provider = anthropic(stream_error(reply, kind, "it went wrong"))

    with pytest.raises(expected) as raised:
        provider.complete(replace(request("claude-test"), deltas=Recorder()))

    assert type(raised.value) is expected
    assert "it went wrong" in str(raised.value)
