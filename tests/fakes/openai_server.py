"""An OpenAI-compatible chat-completions server over real HTTP, answering from a script.

A test queues the replies, in order, that ``POST /v1/chat/completions`` gives::

    openai_server.reply(
        tool_call("calculator", {"expression": "6*7"}, call_id="call_1"),
        error(500),
        answer("The answer is 42.", prompt_tokens=30, completion_tokens=7),
    )

A reply is a completion (tool calls with ``finish_reason: "tool_calls"``, or a final text
answer, each with ``usage``), an HTTP error (status, body and headers such as ``Retry-After``),
a stall (no answer for a while, to outlast the client's timeout) or a drip (an answer that
begins and never ends, a byte now and then, so no read of the client ever times out). A
request that finds the queue empty gets a 500 that says so, unless the server has a
``responder``: a function that computes the reply from the request, for tests whose replies
depend on what was asked (many tasks at once, or requests repeated after a crash)::

    def respond(request: Received) -> Reply:
        steps_so_far = sum(m["role"] == "assistant" for m in request.messages)
        return answer("done") if steps_so_far else tool_call("calculator", {"expression": "1"})

    with OpenAIServer(responder=respond) as server: ...

Queued replies still come first. Every request is recorded (method, path, headers, parsed
JSON body, arrival time), so a test can assert exactly what the provider sent.

A request with ``"stream": true`` gets its completion as the real API streams one: server-sent
``chat.completion.chunk`` events (a role chunk, the text in pieces, each tool call's id and name
and then its arguments in pieces, a ``finish_reason`` chunk, the usage in a last chunk when
``stream_options.include_usage`` asks, then ``data: [DONE]``), chunked on a kept-alive
connection. ``answer("…", chunks=50, seconds=2.0)`` sends the text in 50 pieces over 2 s; each
piece's send time is recorded (``sent``), and a stream the client cut off counts as
undelivered. ``OpenAIServer(streams=False)`` is a server that ignores ``stream`` (some
OpenAI-compatible servers do) and always answers with the whole completion.

Use the fixture by importing it into a test module::

    from tests.fakes.openai_server import openai_server  # noqa: F401
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

import pytest

COMPLETIONS_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Call:
    """One tool call the model asks for; ``arguments`` as a str is sent raw (e.g. bad JSON)."""

    name: str
    arguments: Mapping[str, Any] | str = field(default_factory=dict)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class Completion:
    """A 200 answer: tool calls, or final text when there are none."""

    content: str | None = None
    calls: tuple[Call, ...] = ()
    prompt_tokens: int = 20
    completion_tokens: int = 10
    # Reported in usage's details when set: of the prompt, read from the prompt cache; of the
    # completion, spent reasoning.
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    # Streamed: the text (or, without text, each call's arguments) in this many pieces
    # (None: about four characters each), spread over ``seconds``.
    chunks: int | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class ErrorReply:
    """An HTTP error; ``body`` defaults to OpenAI's ``{"error": {...}}`` shape."""

    status: int
    message: str = "the test server was told to fail"
    headers: Mapping[str, str] = field(default_factory=dict)
    body: Any = None


@dataclass(frozen=True)
class Stall:
    """Say nothing for ``seconds`` (past the client's timeout), then send ``then`` if anyone is
    still listening."""

    seconds: float
    then: Completion | ErrorReply | None = None


@dataclass(frozen=True)
class Drip:
    """A 200 whose body never comes: after the head, a space every ``interval`` seconds (JSON
    allows them before a value) until the server closes. No read of the client waits as long
    as its timeout: only a deadline on the whole call ends it."""

    interval: float = 0.1


Reply = Completion | ErrorReply | Stall | Drip
Responder = Callable[["Received"], Reply]


def tool_call(
    name: str,
    arguments: Mapping[str, Any] | str | None = None,
    *,
    call_id: str | None = None,
    prompt_tokens: int = 20,
    completion_tokens: int = 10,
    chunks: int | None = None,
    seconds: float = 0.0,
) -> Completion:
    """A completion that asks for one tool call."""
    call = Call(name, {} if arguments is None else arguments)
    if call_id is not None:
        call = dataclasses.replace(call, id=call_id)
    return Completion(
        calls=(call,),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        chunks=chunks,
        seconds=seconds,
    )


def tool_calls(*calls: Call, prompt_tokens: int = 20, completion_tokens: int = 10) -> Completion:
    """A completion that asks for several tool calls at once."""
    return Completion(calls=calls, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)


def answer(
    content: str,
    *,
    prompt_tokens: int = 20,
    completion_tokens: int = 10,
    chunks: int | None = None,
    seconds: float = 0.0,
) -> Completion:
    """A final text answer (``finish_reason: "stop"``); streamed, in ``chunks`` pieces over
    ``seconds``."""
    return Completion(
        content=content,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        chunks=chunks,
        seconds=seconds,
    )


def error(
    status: int,
    message: str = "the test server was told to fail",
    *,
    headers: Mapping[str, str] | None = None,
    body: Any = None,
) -> ErrorReply:
    return ErrorReply(status, message, dict(headers or {}), body)


def stall(seconds: float, then: Completion | ErrorReply | None = None) -> Stall:
    return Stall(seconds, then)


def drip(interval: float = 0.1) -> Drip:
    return Drip(interval)


@dataclass(frozen=True)
class Received:
    """One request as the server saw it. ``body`` is the parsed JSON (or the raw text)."""

    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: Any
    at: float  # time.monotonic() on arrival

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body["messages"])


class OpenAIServer:
    """The server, its reply queue and its request log. Thread-safe; a context manager."""

    def __init__(self, responder: Responder | None = None, *, streams: bool = True) -> None:
        self._responder = responder
        self.streams = streams
        self._replies: deque[Reply] = deque()
        self._received: list[Received] = []
        self._undelivered: list[float] = []  # arrival times of requests whose answer was lost
        self._sent: list[tuple[float, str]] = []  # (time.time(), text) of each streamed piece
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._ids = itertools.count(1)
        self._httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.fake = self
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="fake-openai",
            daemon=True,
        )

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def base_url(self) -> str:
        """What ``RATCHET_OPENAI_BASE_URL`` should be."""
        return f"{self.url}/v1"

    @property
    def requests(self) -> list[Received]:
        with self._lock:
            return list(self._received)

    @property
    def undelivered(self) -> set[float]:
        """Arrival times (``Received.at``) of the requests whose answer could not be written:
        the client had gone (killed, or its connection dropped), so it may ask again."""
        with self._lock:
            return set(self._undelivered)

    @property
    def sent(self) -> list[tuple[float, str]]:
        """Each streamed piece of text or arguments: when it was sent (``time.time()``, so
        another process can compare) and what it held, in order."""
        with self._lock:
            return list(self._sent)

    @property
    def pending(self) -> int:
        """Replies queued and not yet given."""
        with self._lock:
            return len(self._replies)

    def reply(self, *replies: Reply) -> None:
        """Queue replies; each request takes the next one."""
        with self._lock:
            self._replies.extend(replies)

    def start(self) -> OpenAIServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing.set()  # wakes stalled handlers at once
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _record(self, request: Received) -> Reply:
        with self._lock:
            self._received.append(request)
            if request.method != "POST" or request.path != COMPLETIONS_PATH:
                return ErrorReply(404, f"no route {request.method} {request.path}")
            if self._replies:
                return self._replies.popleft()
        if self._responder is not None:
            # Outside the lock: a responder may take its time without holding up other requests.
            return self._responder(request)
        return ErrorReply(500, "the test server has no scripted reply left")

    def _completion_body(self, reply: Completion, model: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
        if reply.calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": call.arguments
                        if isinstance(call.arguments, str)
                        else json.dumps(call.arguments),
                    },
                }
                for call in reply.calls
            ]
        return {
            "id": f"chatcmpl-test-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "tool_calls" if reply.calls else "stop",
                }
            ],
            "usage": _usage(reply),
        }

    def _chunks(self, reply: Completion, model: str, *, usage: bool) -> list[tuple[str, Any]]:
        """The completion as the stream's chunks: ``(piece, chunk)``, the piece of text or
        arguments it carries (empty for the others)."""
        head = {
            "id": f"chatcmpl-test-{next(self._ids)}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": None,
        } | ({"usage": None} if usage else {})

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return head | {"choices": [choice]}

        chunks: list[tuple[str, Any]] = [("", chunk({"role": "assistant", "content": ""}))]
        count = reply.chunks
        if reply.content:
            for piece in _pieces(reply.content, count):
                chunks.append((piece, chunk({"content": piece})))
        for index, call in enumerate(reply.calls):
            raw = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
            function = {"name": call.name, "arguments": ""}
            named = {"index": index, "id": call.id, "type": "function", "function": function}
            chunks.append(("", chunk({"tool_calls": [named]})))
            each = None if count is None or reply.content else max(1, count // len(reply.calls))
            for piece in _pieces(raw, each):
                more = {"index": index, "function": {"arguments": piece}}
                chunks.append((piece, chunk({"tool_calls": [more]})))
        chunks.append(("", chunk({}, "tool_calls" if reply.calls else "stop")))
        if usage:
            chunks.append(("", head | {"choices": [], "usage": _usage(reply)}))
        return chunks


def _pieces(text: str, count: int | None) -> list[str]:
    """``text`` in ``count`` pieces as even as may be (None: about four characters each)."""
    if not text:
        return []
    count = max(1, min(len(text), count if count is not None else -(-len(text) // 4)))
    size, extra = divmod(len(text), count)
    bounds = [i * size + min(i, extra) for i in range(count + 1)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def _usage(reply: Completion) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }
    if reply.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": reply.cached_tokens, "audio_tokens": 0}
    if reply.reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reply.reasoning_tokens}
    return usage


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # hundreds of workers' threads may connect at once
    fake: OpenAIServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def do_POST(self) -> None:
        self._handle()

    def do_GET(self) -> None:
        self._handle()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the request log is self.server.fake.requests

    def _handle(self) -> None:
        fake = self.server.fake
        received = Received(
            method=self.command,
            path=self.path.partition("?")[0],
            headers={name.lower(): value for name, value in self.headers.items()},
            body=self._read_body(),
            at=time.monotonic(),
        )
        reply: Reply | None = fake._record(received)
        if isinstance(reply, Drip):
            self._drip(reply.interval)
            return
        if isinstance(reply, Stall):
            if fake._closing.wait(reply.seconds):
                return
            reply = reply.then
        if reply is None:
            reply = answer("(answered after a stall)")
        body = received.body if isinstance(received.body, dict) else {}
        model = body.get("model", "")
        try:
            if isinstance(reply, Completion) and body.get("stream") and fake.streams:
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                self._stream(reply, fake._chunks(reply, model, usage=usage))
            elif isinstance(reply, Completion):
                self._send(200, fake._completion_body(reply, model))
            else:
                self._send_error(reply)
        except (BrokenPipeError, ConnectionResetError):
            with fake._lock:  # the client gave up or went away: nothing to tell it
                fake._undelivered.append(received.at)

    def _stream(self, reply: Completion, chunks: list[tuple[str, Any]]) -> None:
        """Send ``chunks`` as server-sent events, the pieces ``reply.seconds`` apart in all."""
        fake = self.server.fake
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        gap = reply.seconds / max(1, sum(1 for piece, _ in chunks if piece))
        for piece, chunk in chunks:
            if piece and gap and fake._closing.wait(gap):
                return
            self._write_chunk(f"data: {json.dumps(chunk)}\n\n".encode())
            if piece:
                with fake._lock:
                    fake._sent.append((time.time(), piece))
        self._write_chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _drip(self, interval: float) -> None:
        closing = self.server.fake._closing
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "1000000")
        self.end_headers()
        try:
            while not closing.wait(interval):
                self.wfile.write(b" ")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on it: what its deadline is for
        self.close_connection = True

    def _read_body(self) -> Any:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return raw.decode(errors="replace")

    def _send_error(self, reply: ErrorReply) -> None:
        body = reply.body
        if body is None:
            body = {
                "error": {
                    "message": reply.message,
                    "type": "invalid_request_error" if reply.status < 500 else "server_error",
                    "param": None,
                    "code": None,
                }
            }
        self._send(reply.status, body, reply.headers)

    def _send(self, status: int, body: Any, headers: Mapping[str, str] | None = None) -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-request-id", f"req_{uuid.uuid4().hex[:16]}")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()


@pytest.fixture
def openai_server() -> Iterator[OpenAIServer]:
    """A running fake OpenAI server with an empty reply queue; closed after the test."""
    with OpenAIServer() as server:
        yield server
