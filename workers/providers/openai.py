"""``openai:<model>``: any OpenAI-compatible chat-completions endpoint, via the official SDK.

The SDK's own retries are off: Ratchet decides about retries, so it can count them, honour
``Retry-After`` and send long waits back through the queue.

A call given ``Deltas`` streams (``stream: true``, with the usage in the last chunk): each
chunk's text and tool-call argument pieces go to the deltas as they come, and the answer
put together from them is the same ``ModelResponse`` the whole completion would give.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import httpx
import openai

from shared.errors import ModelPermanentError, ModelRateLimited, ModelTransientError
from shared.settings import get_settings
from workers.providers import parts, structured
from workers.providers.base import (
    Deltas,
    Message,
    ModelRequest,
    ModelResponse,
    Sharded,
    ToolCallRequest,
    body_chunks,
    broken_stream,
    classify_error,
    is_event_stream,
    local_names,
    parse_arguments,
    shut,
    sse_data,
    tls_context,
    wire_name,
)

PASSED_OPTIONS = (
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "response_format",
    "parallel_tool_calls",
    "tool_choice",
    "reasoning_effort",
)


def to_openai_messages(messages: list[Message]) -> list[dict[str, Any]]:
    wire: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            wire.append(
                {
                    "role": "tool",
                    "tool_call_id": message["tool_call_id"],
                    "content": message["content"],
                }
            )
        elif message["role"] == "assistant" and message.get("tool_calls"):
            wire.append(
                {
                    "role": "assistant",
                    "content": message.get("content"),
                    "tool_calls": [
                        {
                            "id": call["id"],
                            "type": "function",
                            "function": {
                                "name": wire_name(call["name"]),
                                "arguments": json.dumps(call["arguments"]),
                            },
                        }
                        for call in message["tool_calls"]
                    ],
                }
            )
        else:
            wire.append(
                {"role": message["role"], "content": parts.to_openai(message.get("content"))}
            )
    return wire


def map_error(exc: openai.OpenAIError) -> Exception:
    """Sort an SDK error into transient (retry) or permanent (fail the task)."""
    return classify_error(
        exc,
        timeout=openai.APITimeoutError,
        connection=openai.APIConnectionError,
        status=openai.APIStatusError,
    )


class OpenAIProvider:
    @cached_property
    def clients(self) -> Sharded[openai.OpenAI]:
        return Sharded(self._new_client)

    @property
    def client(self) -> openai.OpenAI:
        """The SDK client of this thread's group."""
        return self.clients.get()

    def _new_client(self) -> openai.OpenAI:
        settings = get_settings()
        key = settings.openai_api_key.get_secret_value() if settings.openai_api_key else None
        return openai.OpenAI(
            api_key=key or "not-set",
            base_url=settings.openai_base_url,
            timeout=settings.model_timeout_seconds,
            max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=tls_context()),
        )

    def complete(self, request: ModelRequest) -> ModelResponse:
        options = {k: v for k, v in request.options.items() if k in PASSED_OPTIONS}
        if request.tools:
            options["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": wire_name(t.name),
                        "description": t.description,
                        "parameters": t.parameters,
                    },
                }
                for t in request.tools
            ]
        if request.output_schema is not None and "response_format" not in options:
            options["response_format"] = structured.response_format(request.output_schema)
        body = {"model": request.model, "messages": to_openai_messages(request.messages)}
        if request.deltas is not None:
            completion = self._streamed(body | options, request.deltas)
            return local_names(parse_completion(completion), request.tools)
        try:
            # The SDK's own HTTP layer (auth, timeouts, error mapping), without the typed
            # request and response models of ``chat.completions.create``: walking a long
            # conversation through them costs more CPU than the rest of the step.
            raw = self.client.post("/chat/completions", cast_to=httpx.Response, body=body | options)
            completion = raw.json()
        except openai.OpenAIError as exc:
            raise map_error(exc) from exc
        except ValueError as exc:
            raise ModelPermanentError(f"the model provider answered with bad JSON: {exc}") from exc
        return local_names(parse_completion(completion), request.tools)

    def _streamed(self, body: dict[str, Any], deltas: Deltas) -> dict[str, Any]:
        """The completion, streamed into ``deltas`` as it comes; a stop ends it at once."""
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        try:
            response = self.client.post(
                "/chat/completions", cast_to=httpx.Response, body=body, stream=True
            )
        except openai.OpenAIError as exc:
            raise map_error(exc) from exc
        with contextlib.closing(response), deltas.stopping(lambda: shut(response)):
            try:
                if not is_event_stream(response):
                    whole: dict[str, Any] = json.loads(response.read())
                    return whole
                return read_stream(sse_data(body_chunks(response)), deltas)
            except httpx.HTTPError as exc:
                raise broken_stream(exc) from exc
            except ValueError as exc:
                raise ModelPermanentError(f"the model provider streamed bad JSON: {exc}") from exc


def read_stream(events: Iterator[bytes], deltas: Deltas) -> dict[str, Any]:
    """A streamed completion's chunks (``chat.completion.chunk``, then ``[DONE]``) put back
    together as the whole completion, each piece handed to ``deltas`` on the way. Tool calls
    come in pieces by their ``index``: the first names the call's id and function, the rest
    carry more of its arguments. With ``include_usage`` the usage comes in a last chunk."""
    text: list[str] = []
    calls: dict[int, tuple[str, str, list[str]]] = {}
    usage: Any = None
    finished = False
    for data in events:
        if data == b"[DONE]":
            # Read on to the body's end: a response left unread costs its connection, and the
            # next call a new one (a TLS handshake, in production).
            finished = True
            continue
        chunk = json.loads(data)
        if chunk.get("error"):
            raise stream_error(chunk["error"])
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            piece = delta.get("content")
            if piece:
                text.append(piece)
                deltas.text(piece)
            for call in delta.get("tool_calls") or ():
                _call_piece(call, calls, deltas)
            finished = finished or bool(choice.get("finish_reason"))
    if not finished:
        raise ModelTransientError("the model provider's stream ended before its answer did")
    message: dict[str, Any] = {"content": "".join(text) if text or not calls else None}
    if calls:
        message["tool_calls"] = [
            {"id": id_, "type": "function", "function": {"name": name, "arguments": "".join(args)}}
            for id_, name, args in (calls[index] for index in sorted(calls))
        ]
    return {"choices": [{"message": message}], "usage": usage}


def _call_piece(
    call: dict[str, Any], calls: dict[int, tuple[str, str, list[str]]], deltas: Deltas
) -> None:
    """One chunk's piece of a tool call, added to ``calls`` and handed to ``deltas``."""
    index = int(call.get("index") or 0)
    function = call.get("function") or {}
    arguments = function.get("arguments") or ""
    known = calls.get(index)
    if known is None:
        call_id, name = call.get("id") or "", function.get("name") or ""
        calls[index] = known = (call_id, name, [])
        deltas.tool_call(index, call_id=call_id, name=name, arguments=arguments)
    elif arguments:
        deltas.tool_call(index, call_id="", name="", arguments=arguments)
    if arguments:
        known[2].append(arguments)


def stream_error(error: Any) -> Exception:
    """An error sent in the stream, after its 200 head: a rate limit as a 429 would be, the
    rest as the provider's server error (transient)."""
    said = error.get("message") if isinstance(error, dict) else error
    kind = error.get("type") or error.get("code") if isinstance(error, dict) else None
    message = f"the model provider's stream ended with an error: {said}"
    if kind in ("rate_limit_exceeded", "rate_limit_error", "requests", "tokens"):
        return ModelRateLimited(message)
    return ModelTransientError(message)


def parse_completion(completion: Any) -> ModelResponse:
    """A chat completion's first choice, as Ratchet's response."""
    choices = completion.get("choices") if isinstance(completion, dict) else None
    if not choices:
        raise ModelPermanentError("the model provider returned no choices")
    message = choices[0].get("message") or {}
    calls = []
    for call in message.get("tool_calls") or []:
        if call.get("type", "function") != "function":
            continue
        function = call.get("function") or {}
        arguments, invalid = parse_arguments(function.get("arguments"))
        calls.append(
            ToolCallRequest(call.get("id", ""), function.get("name", ""), arguments, invalid)
        )
    usage = completion.get("usage") or {}
    return ModelResponse(
        content=message.get("content"),
        tool_calls=calls,
        input_tokens=int(usage.get("prompt_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens") or 0),
        # Of the prompt, read from OpenAI's prompt cache; of the completion, spent reasoning.
        cached_input_tokens=_detail(usage, "prompt_tokens_details", "cached_tokens"),
        reasoning_tokens=_detail(usage, "completion_tokens_details", "reasoning_tokens"),
    )


def _detail(usage: dict[str, Any], group: str, name: str) -> int:
    """A count from one of the usage's details objects (absent, or null, on many servers)."""
    details = usage.get(group)
    value = details.get(name) if isinstance(details, dict) else None
    return value if isinstance(value, int) and value > 0 else 0
