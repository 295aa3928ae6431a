"""An OpenAI-compatible chat-completions server that answers after a fixed latency.

For load benchmarks: it stands in for a slow provider so that what is measured is how many
calls Ratchet keeps in flight, not how fast a real model is. Each request sleeps on the event
loop, so hundreds of concurrent calls cost it almost no CPU (a raw ASGI app under uvicorn,
with no framework in the way)::

    python -m benchmarks.servers.llm_stub --port 9100 --latency-ms 2000 --tool-steps 2

``POST /v1/chat/completions`` asks for one ``calculator`` tool call while the conversation
holds fewer than ``--tool-steps`` tool results, then answers "done". ``GET /stats`` reports
the calls in flight now and at peak, the calls completed and the seconds they took in all;
``POST /stats/reset`` zeroes them.

With ``--chunks N``, a request with ``"stream": true`` is answered as the real API streams:
``chat.completion.chunk`` events, the latency spread over ``N`` pieces (a tool call's arguments
in pieces; a final answer's text made of ``N`` marks, each ``<send time>;`` as ``time.time()``
read when the piece went out, so a reader can tell how long each piece took to reach it), the
usage in a last chunk, then ``[DONE]``. Without it, ``stream`` is ignored (the whole answer).

With ``--http-tool``, the tool call asked for is ``http_request`` of this server's own
``GET /receiver``, which answers a small JSON body after ``--receiver-latency-ms``: an HTTP
tool that costs a few ms of waiting (its calls are counted apart, as ``receiver_calls``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

COMPLETIONS_PATH = "/v1/chat/completions"
TOOL_ARGUMENTS = json.dumps({"expression": "6*7"})


@dataclass
class Stats:
    """What the benchmark reads back: concurrency as the provider saw it."""

    in_flight: int = 0
    peak: int = 0
    calls: int = 0
    busy_seconds: float = 0.0
    receiver_calls: int = 0

    def begin_call(self) -> None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)

    def end_call(self, seconds: float) -> None:
        self.in_flight -= 1
        self.calls += 1
        self.busy_seconds += seconds

    def reset(self) -> None:
        """Zero the counters; calls still in flight stay counted as in flight."""
        self.peak, self.calls, self.busy_seconds = self.in_flight, 0, 0.0
        self.receiver_calls = 0


def _prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """About four characters a token, plus a few per message: plausible, not exact."""
    return sum(4 + len(str(m.get("content") or "")) // 4 for m in messages)


@dataclass(frozen=True)
class ToolAsked:
    """The tool call the stub asks for: its name and its arguments' JSON text."""

    name: str = "calculator"
    arguments: str = TOOL_ARGUMENTS


def complete_chat(
    request: dict[str, Any], *, tool_steps: int, number: int, tool: ToolAsked = ToolAsked()
) -> dict[str, Any]:
    """The reply to one chat-completions request, in the shape the official SDK parses."""
    messages = list(request.get("messages") or [])
    tool_results = sum(m.get("role") == "tool" for m in messages)
    message: dict[str, Any] = {"role": "assistant", "content": "done", "refusal": None}
    finish_reason, completion_tokens = "stop", 1
    if tool_results < tool_steps:
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        function = {"name": tool.name, "arguments": tool.arguments}
        message["content"] = None
        message["tool_calls"] = [{"id": call_id, "type": "function", "function": function}]
        finish_reason, completion_tokens = "tool_calls", 12
    prompt_tokens = _prompt_tokens(messages)
    return {
        "id": f"chatcmpl-stub-{number}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(request.get("model") or "stub"),
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


class Stub:
    """The ASGI app: one instance holds the latency, the script length and the counters."""

    def __init__(
        self,
        *,
        latency_s: float,
        tool_steps: int,
        tool: ToolAsked = ToolAsked(),
        receiver_latency_s: float = 0.005,
        chunks: int = 0,
    ) -> None:
        self.chunks = chunks
        self.latency_s = latency_s
        self.tool_steps = tool_steps
        self.tool = tool
        self.receiver_latency_s = receiver_latency_s
        self.stats = Stats()
        self._numbers = itertools.count(1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan and websockets: nothing to set up, nothing to serve
        body = await _read_body(receive)
        route = (scope["method"], scope["path"])
        if route == ("POST", COMPLETIONS_PATH) and self.chunks and _streamed(body):
            await self._stream(send, body)
        elif route == ("POST", COMPLETIONS_PATH):
            await _send_json(send, 200, payload=await self._complete(body))
        elif route == ("GET", "/receiver"):
            await asyncio.sleep(self.receiver_latency_s)
            self.stats.receiver_calls += 1
            await _send_json(send, 200, payload={"ok": True, "answer": 42})
        elif route == ("GET", "/stats"):
            await _send_json(send, 200, payload=asdict(self.stats))
        elif route == ("POST", "/stats/reset"):
            self.stats.reset()
            await _send_json(send, 200, payload=asdict(self.stats))
        else:
            await _send_json(send, 404, payload={"error": {"message": f"no route {route}"}})

    async def _complete(self, body: bytes) -> dict[str, Any]:
        started = time.monotonic()
        self.stats.begin_call()
        try:
            await asyncio.sleep(self.latency_s)
            request = json.loads(body or b"{}")
            number = next(self._numbers)
            return complete_chat(request, tool_steps=self.tool_steps, number=number, tool=self.tool)
        finally:
            self.stats.end_call(time.monotonic() - started)

    async def _stream(self, send: Send, body: bytes) -> None:
        """The answer as a stream of chunks, ``self.chunks`` pieces over the latency."""
        started = time.monotonic()
        self.stats.begin_call()
        try:
            request = json.loads(body)
            whole = complete_chat(
                request, tool_steps=self.tool_steps, number=next(self._numbers), tool=self.tool
            )
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            head = {k: whole[k] for k in ("id", "model", "created")}
            head |= {"object": "chat.completion.chunk", "usage": None}
            message = whole["choices"][0]["message"]
            calls = message.get("tool_calls")
            raw = calls[0]["function"]["arguments"] if calls else ""
            gap = self.latency_s / self.chunks
            if calls:
                named = {
                    **calls[0],
                    "index": 0,
                    "function": {**calls[0]["function"]} | {"arguments": ""},
                }
                await _chunk(send, head, {"role": "assistant", "tool_calls": [named]})
            for n in range(self.chunks):
                await asyncio.sleep(gap)
                if calls:
                    piece = raw[n * len(raw) // self.chunks : (n + 1) * len(raw) // self.chunks]
                    await _chunk(
                        send, head, {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
                    )
                else:
                    await _chunk(send, head, {"content": f"{time.time():.6f};"})
            finish = whole["choices"][0]["finish_reason"]
            await _chunk(send, head, {}, finish=finish)
            await _event(send, head | {"choices": [], "usage": whole["usage"]})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finally:
            self.stats.end_call(time.monotonic() - started)


def _streamed(body: bytes) -> bool:
    return bool(json.loads(body or b"{}").get("stream"))


async def _chunk(
    send: Send, head: dict[str, Any], delta: dict[str, Any], *, finish: str | None = None
) -> None:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    await _event(send, head | {"choices": [choice]})


async def _event(send: Send, chunk: dict[str, Any]) -> None:
    data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send_json(send: Send, status: int, *, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--latency-ms", type=float, default=2000.0)
    parser.add_argument("--tool-steps", type=int, default=2)
    parser.add_argument("--http-tool", action="store_true", help="ask for http_request calls")
    parser.add_argument("--receiver-latency-ms", type=float, default=5.0)
    parser.add_argument("--chunks", type=int, default=0, help="stream when asked, in N pieces")
    args = parser.parse_args(argv)
    import uvicorn

    tool = ToolAsked()
    if args.http_tool:
        url = f"http://{args.host}:{args.port}/receiver"
        tool = ToolAsked("http_request", json.dumps({"url": url}))
    stub = Stub(
        latency_s=args.latency_ms / 1000,
        tool_steps=args.tool_steps,
        tool=tool,
        receiver_latency_s=args.receiver_latency_ms / 1000,
        chunks=args.chunks,
    )
    # A backlog deep enough for every benchmark client to connect at once.
    uvicorn.run(
        stub,
        host=args.host,
        port=args.port,
        lifespan="off",
        access_log=False,
        log_level="warning",
        backlog=4096,
        # Longer than any client's keep-alive: a connection the client takes from its pool as
        # the server closes it would be a failed call.
        timeout_keep_alive=120,
    )


if __name__ == "__main__":
    main()
