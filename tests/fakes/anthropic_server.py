"""An Anthropic Messages-API server over real HTTP on 127.0.0.1, answering from a script.

A test gives the replies, in order, as ``(status, body)`` pairs; each ``POST /v1/messages``
takes the next one, and the server records what it was sent (path, JSON body, ``x-api-key``)::

    server = MessagesServer([(200, message([text("hi")], "end_turn", tokens=(12, 5)))])
    ...
    [sent] = server.requests

Replies are built with :func:`message` (content blocks, the stop reason and the usage the API
reports, prompt-cache reads and writes included: Anthropic's ``input_tokens`` leaves those
out) from :func:`text`, :func:`tool_use`, :func:`thinking` and :func:`redacted_thinking`.

Before it answers, the server checks a request as the real API does where Ratchet could get it
wrong, and answers ``400 invalid_request_error`` (taking no reply) when it breaks a rule:
``max_tokens`` is required and above a thinking budget; at most four ``cache_control``
breakpoints; with thinking on, an assistant turn that called tools starts with its thinking
block, sent back with its signature exactly as it was given out.

A request with ``"stream": true`` gets a 200 reply as the API streams it: ``message_start``
(the usage known at the start), per block ``content_block_start``, its pieces as
``content_block_delta`` (``text_delta``, ``input_json_delta``, ``thinking_delta`` then one
``signature_delta``; a redacted block comes whole) and ``content_block_stop``, then
``message_delta`` (the stop reason and the output usage) and ``message_stop``. A reply made
with :func:`stream_error` breaks off mid-stream with an ``error`` event after its first block.
"""

from __future__ import annotations

import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MESSAGES_PATH = "/v1/messages"
MAX_BREAKPOINTS = 4
THINKING_TYPES = ("thinking", "redacted_thinking")


class MessagesServer:
    def __init__(self, replies: list[tuple[int, dict[str, Any]]]) -> None:
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []
        self.given_thinking: list[dict[str, Any]] = []  # every thinking block handed out
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                status, reply = outer.answer(self.path, body, self.headers.get("x-api-key"))
                if status == 200 and body.get("stream"):
                    self.stream(stream_events(reply))
                    return
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def stream(self, events: list[dict[str, Any]]) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for event in events:
                    data = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str, body: Any, key: str | None) -> tuple[int, dict[str, Any]]:
        """Record the request; the next reply, or the error the API would give."""
        with self._lock:
            self.requests.append({"path": path, "body": body, "key": key})
            if path != MESSAGES_PATH:
                return 404, api_error("not_found_error", f"no route {path}")
            problem = check_request(body, given=self.given_thinking)
            if problem is not None:
                return 400, api_error("invalid_request_error", problem)
            if not self.replies:
                return 500, api_error("api_error", "the test server has no scripted reply left")
            status, reply = self.replies.pop(0)
            if status == 200:
                self.given_thinking.extend(
                    b for b in reply.get("content", []) if b.get("type") in THINKING_TYPES
                )
            return status, reply

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> MessagesServer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def check_request(body: Any, *, given: list[dict[str, Any]]) -> str | None:
    """What the real API would refuse in ``body`` (of the rules above), or None."""
    if not isinstance(body, dict) or not isinstance(body.get("max_tokens"), int):
        return "max_tokens: Field required"
    thinking_on = (body.get("thinking") or {}).get("type") == "enabled"
    if thinking_on and body["max_tokens"] <= body["thinking"].get("budget_tokens", 0):
        return "`max_tokens` must be greater than `thinking.budget_tokens`"
    if count_breakpoints(body) > MAX_BREAKPOINTS:
        return f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided"
    for index, turn in enumerate(body.get("messages") or []):
        content = turn.get("content")
        if turn.get("role") != "assistant" or not isinstance(content, list):
            continue
        for block in content:
            if block.get("type") in THINKING_TYPES and block not in given:
                return f"messages.{index}.content: a thinking block was changed or made up"
        called = any(block.get("type") == "tool_use" for block in content)
        if thinking_on and called and content[0].get("type") not in THINKING_TYPES:
            return (
                f"messages.{index}.content.0.type: Expected `thinking` or `redacted_thinking`, "
                f"but found `{content[0].get('type')}`. When `thinking` is enabled, a final "
                "`assistant` message must start with a thinking block"
            )
    return None


def count_breakpoints(body: dict[str, Any]) -> int:
    blocks: list[Any] = []
    system = body.get("system")
    if isinstance(system, list):
        blocks.extend(system)
    blocks.extend(body.get("tools") or [])
    for turn in body.get("messages") or []:
        if isinstance(turn.get("content"), list):
            blocks.extend(turn["content"])
    return sum(1 for block in blocks if isinstance(block, dict) and "cache_control" in block)


def cache_breakpoints(body: dict[str, Any]) -> list[str]:
    """Where a request put ``cache_control``: ``system[i]``, ``tools[i]`` or
    ``messages[i].content[j]``."""
    found: list[str] = []
    system = body.get("system")
    if isinstance(system, list):
        found += [f"system[{i}]" for i, b in enumerate(system) if "cache_control" in b]
    found += [f"tools[{i}]" for i, t in enumerate(body.get("tools") or []) if "cache_control" in t]
    for i, turn in enumerate(body.get("messages") or []):
        if isinstance(turn.get("content"), list):
            found += [
                f"messages[{i}].content[{j}]"
                for j, b in enumerate(turn["content"])
                if "cache_control" in b
            ]
    return found


_ids = itertools.count(1)


def message(
    content: list[dict[str, Any]],
    stop: str,
    *,
    tokens: tuple[int, int],
    cache_read: int = 0,
    cache_write: int = 0,
    thinking_tokens: int | None = None,
) -> dict[str, Any]:
    """A Messages-API answer: ``content`` blocks, the stop reason and its usage: ``tokens`` is
    (input, output) as Anthropic counts them, the input without the ``cache_read`` and
    ``cache_write`` tokens."""
    usage: dict[str, Any] = {
        "input_tokens": tokens[0],
        "output_tokens": tokens[1],
        "cache_read_input_tokens": cache_read,
        "cache_creation_input_tokens": cache_write,
    }
    if thinking_tokens is not None:
        usage["output_tokens_details"] = {"thinking_tokens": thinking_tokens}
    return {
        "id": f"msg_{next(_ids)}",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": usage,
    }


PIECE = 5  # characters of text, thinking or tool input a streamed delta carries


def stream_events(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """A Messages-API answer as the events of its stream (see the module's docstring)."""
    usage = dict(reply["usage"])
    start_usage = usage | {"output_tokens": 1}
    start_usage.pop("output_tokens_details", None)
    message = {k: v for k, v in reply.items() if k not in ("content", "usage", "stream_error")}
    events: list[dict[str, Any]] = [
        {
            "type": "message_start",
            "message": message | {"content": [], "stop_reason": None, "usage": start_usage},
        }
    ]
    for index, block in enumerate(reply["content"]):
        events += _block_events(index, block)
        if "stream_error" in reply:
            return [*events, {"type": "error", "error": reply["stream_error"]}]
    final = {"output_tokens": usage["output_tokens"]}
    if "output_tokens_details" in usage:
        final["output_tokens_details"] = usage["output_tokens_details"]
    delta = {"stop_reason": reply["stop_reason"], "stop_sequence": None}
    return [
        *events,
        {"type": "message_delta", "delta": delta, "usage": final},
        {"type": "message_stop"},
    ]


def _block_events(index: int, block: dict[str, Any]) -> list[dict[str, Any]]:
    kind = block["type"]
    pieces: list[dict[str, Any]] = []
    if kind == "text":
        start = {"type": "text", "text": ""}
        pieces = [{"type": "text_delta", "text": p} for p in _split(block["text"])]
    elif kind == "tool_use":
        start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
        raw = json.dumps(block["input"])
        pieces = [{"type": "input_json_delta", "partial_json": p} for p in _split(raw)]
    elif kind == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        pieces = [{"type": "thinking_delta", "thinking": p} for p in _split(block["thinking"])]
        pieces.append({"type": "signature_delta", "signature": block["signature"]})
    else:
        start = block  # redacted thinking comes whole
    return [
        {"type": "content_block_start", "index": index, "content_block": start},
        *({"type": "content_block_delta", "index": index, "delta": p} for p in pieces),
        {"type": "content_block_stop", "index": index},
    ]


def _split(text: str) -> list[str]:
    return [text[at : at + PIECE] for at in range(0, len(text), PIECE)]


def stream_error(reply: dict[str, Any], kind: str, message: str) -> dict[str, Any]:
    """``reply`` streamed up to its first block, then broken off by an ``error`` event."""
    return reply | {"stream_error": {"type": kind, "message": message}}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def tool_use(name: str, arguments: dict[str, Any], call_id: str = "toolu_1") -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def thinking(value: str, signature: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": value, "signature": signature}


def redacted_thinking(data: str) -> dict[str, Any]:
    return {"type": "redacted_thinking", "data": data}


def api_error(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}
