"""What every provider takes and returns, in Ratchet's own message format.

Messages are dicts: ``{"role": "system"|"user"|"assistant"|"tool", "content": str|None}``,
assistant messages may carry ``tool_calls: [{"id", "name", "arguments"}]`` and tool messages
carry ``tool_call_id`` and ``name``. A user message's content may instead be a list of parts
(``{"type": "text"|"image"|"file", …}``, see ``workers.providers.parts``). Providers translate
to and from their wire formats.
"""

from __future__ import annotations

import contextlib
import email.utils
import itertools
import json
import math
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Literal, Protocol, TypeVar

import httpx

from shared.errors import (
    ContextLengthExceeded,
    ModelPermanentError,
    ModelRateLimited,
    ModelTransientError,
)

Message = dict[str, Any]
# The most an answer may use when the task sets no ``max_tokens``: what Ratchet sends where
# the API requires a value (Anthropic), and what a budget assumes of the others.
DEFAULT_MAX_TOKENS = 4096


def answer_cap(options: Mapping[str, Any]) -> int:
    """The most an answer may use: the task's ``max_tokens`` (or ``max_completion_tokens``),
    else ``DEFAULT_MAX_TOKENS`` plus any extended-thinking budget (which counts within it)."""
    given = options.get("max_tokens") or options.get("max_completion_tokens")
    if given:
        return int(given)
    thinking = options.get("thinking")
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    return DEFAULT_MAX_TOKENS + (budget if isinstance(budget, int) and budget > 0 else 0)


Client = TypeVar("Client")
CLIENT_SHARDS = 16


class Sharded(Generic[Client]):
    """A few SDK clients, each shared by a group of threads (a thread keeps the one it was
    given first). The HTTP connection pool under the SDKs (httpcore) does work quadratic in
    its connections for every request, so one pool for the hundreds of calls a process has in
    flight would spend more CPU than the calls; sixteen pools of a few dozen do not."""

    def __init__(self, make: Callable[[], Client], shards: int = CLIENT_SHARDS) -> None:
        self._make = make
        self._shards: list[Client | None] = [None] * shards
        self._turn = itertools.count()
        self._mine = threading.local()
        self._lock = threading.Lock()

    def get(self) -> Client:
        index = getattr(self._mine, "index", None)
        if index is None:
            index = self._mine.index = next(self._turn) % len(self._shards)
        client = self._shards[index]
        if client is None:
            with self._lock:
                client = self._shards[index]
                if client is None:
                    client = self._shards[index] = self._make()
        return client


_tls: dict[int, ssl.SSLContext] = {}  # by process id
_tls_lock = threading.Lock()


def tls_context() -> ssl.SSLContext:
    """This process's TLS context (httpx's defaults), shared by every SDK client it makes.
    Building one loads the CA bundle (some 20 ms of CPU): once a process, not once a
    client. A forked child builds its own rather than use its parent's."""
    with _tls_lock:
        context = _tls.get(os.getpid())
        if context is None:
            context = _tls[os.getpid()] = httpx.create_ssl_context()
        return context


@dataclass(frozen=True)
class ToolSchema:
    name: str
    description: str
    parameters: dict[str, Any]


class Deltas(Protocol):
    """Where a streaming call hands its answer as it comes (``workers.gatherer`` gathers it for
    the task's live readers). A provider that is given one streams; without one it asks for
    the whole answer at once."""

    def text(self, delta: str) -> None:
        """More of the answer's text."""

    def tool_call(self, index: int, *, call_id: str, name: str, arguments: str) -> None:
        """More of the tool call at ``index`` (in the answer's order): its id and name (empty
        once given) and the next piece of its JSON arguments."""

    def stopping(self, stop: Callable[[], None]) -> AbstractContextManager[None]:
        """While the block runs, call ``stop`` (from any thread) when the call must end at
        once (its task was cancelled, or it was abandoned); at once if that already happened.
        Never after the block: by then the connection may serve another call."""

    @property
    def stopped(self) -> bool:
        """Whether the call was told to stop."""


@dataclass(frozen=True)
class ModelRequest:
    task_id: str
    step: int
    model: str
    messages: list[Message]
    tools: list[ToolSchema]
    options: dict[str, Any]
    # The JSON Schema the final answer must meet: the provider asks for it in its
    # structured-output mode (``workers.providers.structured``).
    output_schema: dict[str, Any] | None = None
    # What the call is for: a step's answer, or a summary of the conversation so far (the
    # ``summarize`` context policy), which the scripted model writes from the messages.
    purpose: Literal["step", "summary"] = "step"
    # Given: the provider streams the answer into it as it comes (``Deltas``).
    deltas: Deltas | None = None


@dataclass(frozen=True)
class ToolCallRequest:
    id: str
    name: str
    arguments: dict[str, Any]
    invalid_arguments: str | None = None  # the raw text when the model sent malformed JSON


_WIRE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NOT_WIRE = re.compile(r"[^A-Za-z0-9_-]")


def wire_name(name: str) -> str:
    """A tool's name as the providers' APIs take it (letters, digits, ``_`` and ``-``, at most
    64): an MCP tool's ``<server>.<tool>`` goes out as ``<server>__<tool>``."""
    if _WIRE_NAME.fullmatch(name):
        return name
    return _NOT_WIRE.sub("_", name.replace(".", "__"))[:64]


def local_names(response: ModelResponse, tools: list[ToolSchema]) -> ModelResponse:
    """``response`` with its tool calls named as Ratchet names the tools, not as they were
    sent (:func:`wire_name`)."""
    names = {wire_name(t.name): t.name for t in tools if wire_name(t.name) != t.name}
    if not any(call.name in names for call in response.tool_calls):
        return response
    calls = [replace(call, name=names.get(call.name, call.name)) for call in response.tool_calls]
    return replace(response, tool_calls=calls)


@dataclass(frozen=True)
class ModelResponse:
    """A model's answer and its usage. ``input_tokens`` is the whole prompt, the tokens read
    from the provider's prompt cache (``cached_input_tokens``) and written to it
    (``cache_write_tokens``) among them; ``output_tokens`` includes ``reasoning_tokens``.

    ``thinking`` holds the provider's reasoning blocks verbatim (Anthropic's ``thinking`` and
    ``redacted_thinking``, with their signatures): checkpointed with the answer and sent back
    on the assistant turn, as the provider requires on a turn with tool calls."""

    content: str | None
    tool_calls: list[ToolCallRequest] = field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0
    thinking: list[dict[str, Any]] = field(default_factory=list)
    # Why this final answer misses the task's output schema (it goes back to the model).
    output_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        said: dict[str, Any] = {
            "content": self.content,
            "tool_calls": [
                {"id": c.id, "name": c.name, "arguments": c.arguments}
                | ({"invalid_arguments": c.invalid_arguments} if c.invalid_arguments else {})
                for c in self.tool_calls
            ],
        }
        if self.thinking:
            said["thinking"] = self.thinking
        if self.output_error is not None:
            said["output_error"] = self.output_error
        return said

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelResponse:
        return cls(
            content=data.get("content"),
            tool_calls=[
                ToolCallRequest(
                    id=c["id"],
                    name=c["name"],
                    arguments=c.get("arguments") or {},
                    invalid_arguments=c.get("invalid_arguments"),
                )
                for c in data.get("tool_calls", [])
            ],
            thinking=list(data.get("thinking") or []),
            output_error=data.get("output_error"),
        )


class Provider(Protocol):
    def complete(self, request: ModelRequest) -> ModelResponse: ...


def parse_arguments(raw: str | None) -> tuple[dict[str, Any], str | None]:
    """Decode a tool call's JSON arguments; malformed ones are kept raw for the error."""
    if not raw:
        return {}, None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return {}, raw
    return (value, None) if isinstance(value, dict) else ({}, raw)


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds, from either delta-seconds or an HTTP-date; None if it is
    neither (``inf`` and ``nan`` are no wait a step could keep)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        moment = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, moment.timestamp() - time.time())


def estimate_tokens(text: str) -> int:
    """A rough count (about four characters a token) where no tokenizer applies."""
    return max(1, (len(text) + 3) // 4) if text else 0


def classify_error(
    exc: Exception,
    *,
    timeout: type[Exception],
    connection: type[Exception],
    status: type[Exception],
    transient_statuses: tuple[int, ...] = (408,),
) -> Exception:
    """Sort a provider SDK's error into transient (retry) or permanent (fail the task): one
    rule for every SDK, given its timeout, connection and status-error classes."""
    if isinstance(exc, timeout):
        return ModelTransientError("the model provider timed out")
    if isinstance(exc, connection):
        return ModelTransientError(f"cannot reach the model provider: {exc}")
    if isinstance(exc, status):
        code: int = getattr(exc, "status_code", 0)
        headers = getattr(getattr(exc, "response", None), "headers", {})
        retry_after = parse_retry_after(headers.get("retry-after"))
        message = f"the model provider answered {code}: {getattr(exc, 'message', exc)}"
        if code == 429:
            return ModelRateLimited(message, retry_after=retry_after)
        if code >= 500 or code in transient_statuses:
            return ModelTransientError(message, retry_after=retry_after)
        if code == 400 and _too_long(exc):
            return ContextLengthExceeded(
                f"{message} (the model's real context window is smaller than Ratchet's: "
                "set it in RATCHET_MODEL_CONTEXT_WINDOWS)"
            )
        return ModelPermanentError(message)
    return ModelPermanentError(f"model provider error: {exc}")


# How the providers say a prompt is over the window: OpenAI's error code, and the words of
# OpenAI, vLLM ("maximum context length"), Anthropic ("prompt is too long") and others.
_TOO_LONG = re.compile(
    r"context_length_exceeded|context length|context window|prompt is too long|too many tokens",
    re.IGNORECASE,
)


def _too_long(exc: Exception) -> bool:
    said = f"{getattr(exc, 'code', '') or ''} {getattr(exc, 'message', '') or exc}"
    return _TOO_LONG.search(said) is not None


def sse_data(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """The ``data`` of each server-sent event in a body read as ``chunks`` of bytes (both
    providers send one line of JSON an event, and name its type inside it, so ``event:``
    lines are not needed). Split here, on bytes: httpx's text and line decoders cost a
    streamed call more CPU than the rest of its reading."""
    rest = b""
    for chunk in chunks:
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if rest.startswith(b"data:"):
        yield rest[5:].strip()


def body_chunks(response: httpx.Response) -> Iterator[bytes]:
    """A streaming response's body as it arrives: straight from the connection when it is not
    content-encoded (httpx's decoders and chunker cost each streamed piece CPU for nothing
    then), else decoded."""
    if "content-encoding" in response.headers or not isinstance(
        response.stream, httpx.SyncByteStream
    ):
        return response.iter_bytes()
    return iter(response.stream)


def is_event_stream(response: httpx.Response) -> bool:
    """Whether the server streams the answer: some OpenAI-compatible servers ignore
    ``stream: true`` and answer with the whole body, which is then read as it is."""
    return str(response.headers.get("content-type", "")).startswith("text/event-stream")


def shut(response: httpx.Response) -> None:
    """End a streaming response from another thread at once: its socket is shut down, so the
    read that waits on it returns (closing the response from here could leave it waiting),
    and the server sees the connection go."""
    stream = response.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):  # already closed: the read has ended anyway
            sock.shutdown(socket.SHUT_RDWR)


def broken_stream(exc: httpx.HTTPError) -> Exception:
    """A streaming answer that broke off after its head (the SDK maps what comes before): a
    timeout as the SDKs' own, and the rest as an unreachable provider, both transient."""
    if isinstance(exc, httpx.TimeoutException):
        return ModelTransientError("the model provider timed out")
    return ModelTransientError(f"the model provider's stream broke off: {exc}")
