"""``anthropic:<model>``: the Messages API via the official SDK, its own retries off.

Prompt caching is on unless ``RATCHET_ANTHROPIC_PROMPT_CACHING`` or the task's
``model_options.prompt_caching`` turns it off: the stable prefix of every call (the last block
of the system prompt and the last tool definition) carries ``cache_control``, and so does the
conversation's last block, so each step reads the steps before it from the cache instead of
paying for them again.

Extended thinking passes through (``model_options.thinking``, e.g. ``{"type": "enabled",
"budget_tokens": 2048}``). The answer's ``thinking`` and ``redacted_thinking`` blocks are kept
verbatim, signatures and all, and sent back first on their assistant turn: the API requires
them on a turn whose tool calls it is given the results of.

A call given ``Deltas`` streams: the Messages API's events (``message_start``, a
``content_block_start``/``_delta``/``_stop`` run per block, ``message_delta`` with the final
usage) are read off the wire as they come, text and tool-input pieces go to the deltas, and the
blocks put together from them make the same ``ModelResponse`` as a whole answer would.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import anthropic
import httpx

from shared.errors import ModelPermanentError, ModelTransientError
from shared.settings import get_settings
from workers.providers import parts, structured
from workers.providers.base import (
    Deltas,
    Message,
    ModelRequest,
    ModelResponse,
    Sharded,
    ToolCallRequest,
    answer_cap,
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

PASSED_OPTIONS = ("temperature", "top_p", "top_k", "stop_sequences", "tool_choice", "thinking")
THINKING_BLOCKS = ("thinking", "redacted_thinking")
EPHEMERAL = {"type": "ephemeral"}


def to_anthropic(messages: list[Message]) -> tuple[str, list[dict[str, Any]]]:
    """Split out the system prompt and fold tool results into user turns."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system" and m["content"])
    wire: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "system":
            continue
        if role == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": message["tool_call_id"],
                "content": message["content"],
            }
            if wire and wire[-1]["role"] == "user" and isinstance(wire[-1]["content"], list):
                wire[-1]["content"].append(block)
            else:
                wire.append({"role": "user", "content": [block]})
        elif role == "assistant":
            wire.append({"role": "assistant", "content": _assistant_blocks(message)})
        else:
            wire.append({"role": "user", "content": parts.to_anthropic(message.get("content"))})
    return system, wire


def _assistant_blocks(message: Message) -> list[dict[str, Any]]:
    """An assistant turn as the API wants it back: its thinking first (as it came), then its
    text and tool calls."""
    blocks: list[dict[str, Any]] = [dict(block) for block in message.get("thinking") or ()]
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": wire_name(call["name"]),
                "input": call["arguments"],
            }
        )
    return blocks


def mark_cacheable(
    system: str, tools: list[dict[str, Any]], messages: list[dict[str, Any]]
) -> list[dict[str, Any]] | str:
    """Put ``cache_control`` on the last system block, the last tool and the conversation's
    last block (``tools`` and ``messages`` are changed in place); return the system prompt as
    blocks. Three breakpoints of the four the API allows."""
    if tools:
        tools[-1] = tools[-1] | {"cache_control": EPHEMERAL}
    if messages:
        last = messages[-1]
        content = last["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}] if content else []
        if content and content[-1].get("type") not in THINKING_BLOCKS:
            content = [*content[:-1], content[-1] | {"cache_control": EPHEMERAL}]
            messages[-1] = last | {"content": content}
    if not system:
        return system
    return [{"type": "text", "text": system, "cache_control": EPHEMERAL}]


def caching_on(options: dict[str, Any]) -> bool:
    """Prompt caching for this call: the task's ``prompt_caching`` option, else the setting."""
    chosen = options.get("prompt_caching")
    if isinstance(chosen, bool):
        return chosen
    return get_settings().anthropic_prompt_caching


def max_tokens(options: dict[str, Any]) -> int:
    """The most the answer may use, as sent (the API requires a value, above any thinking
    budget): the task's ``max_tokens``, else room for the thinking and an answer."""
    return answer_cap(options)


def map_error(exc: anthropic.AnthropicError) -> Exception:
    """Sort an SDK error into transient (retry) or permanent (fail the task); 529 is
    Anthropic's "overloaded"."""
    return classify_error(
        exc,
        timeout=anthropic.APITimeoutError,
        connection=anthropic.APIConnectionError,
        status=anthropic.APIStatusError,
        transient_statuses=(408, 529),
    )


class AnthropicProvider:
    @cached_property
    def clients(self) -> Sharded[anthropic.Anthropic]:
        return Sharded(self._new_client)

    @property
    def client(self) -> anthropic.Anthropic:
        """The SDK client of this thread's group."""
        return self.clients.get()

    def _new_client(self) -> anthropic.Anthropic:
        settings = get_settings()
        key = settings.anthropic_api_key.get_secret_value() if settings.anthropic_api_key else None
        return anthropic.Anthropic(
            api_key=key or "not-set",
            base_url=settings.anthropic_base_url,
            timeout=settings.model_timeout_seconds,
            max_retries=0,
            http_client=anthropic.DefaultHttpxClient(verify=tls_context()),
        )

    def complete(self, request: ModelRequest) -> ModelResponse:
        system, messages = to_anthropic(request.messages)
        options: dict[str, Any] = {k: v for k, v in request.options.items() if k in PASSED_OPTIONS}
        tools = [
            {"name": wire_name(t.name), "description": t.description, "input_schema": t.parameters}
            for t in request.tools
        ]
        output = structured.for_anthropic(request, tools, options)
        prompt: list[dict[str, Any]] | str = system
        if caching_on(request.options):
            prompt = mark_cacheable(system, tools, messages)
        if prompt:
            options["system"] = prompt
        if tools:
            options["tools"] = tools
        if request.deltas is not None:
            body = {"model": request.model, "max_tokens": max_tokens(request.options)}
            body |= {"messages": messages, **options}
            response = local_names(self._streamed(body, request.deltas), request.tools)
            return response if output is None else output.answer(response)
        try:
            reply = self.client.messages.create(
                model=request.model,
                max_tokens=max_tokens(request.options),
                messages=messages,  # type: ignore[arg-type]
                **options,
            )
        except anthropic.AnthropicError as exc:
            raise map_error(exc) from exc
        response = local_names(parse_message(reply), request.tools)
        return response if output is None else output.answer(response)

    def _streamed(self, body: dict[str, Any], deltas: Deltas) -> ModelResponse:
        """The answer, streamed into ``deltas`` as it comes; a stop ends it at once. Posted
        through the SDK's HTTP layer (auth, version header, timeouts, error mapping) and read
        off the wire: the SDK's typed events cost more CPU than the rest of the call."""
        try:
            response = self.client.post(
                "/v1/messages", cast_to=httpx.Response, body=body | {"stream": True}, stream=True
            )
        except anthropic.AnthropicError as exc:
            raise map_error(exc) from exc
        with contextlib.closing(response), deltas.stopping(lambda: shut(response)):
            try:
                if not is_event_stream(response):
                    return parse_message(
                        anthropic.types.Message.model_validate_json(response.read())
                    )
                return read_stream(sse_data(body_chunks(response)), deltas, response=response)
            except httpx.HTTPError as exc:
                raise broken_stream(exc) from exc
            except ValueError as exc:
                raise ModelPermanentError(f"the model provider streamed bad JSON: {exc}") from exc


def read_stream(
    events: Iterator[bytes], deltas: Deltas, *, response: httpx.Response
) -> ModelResponse:
    """The Messages API's stream put back together as its answer, each text and tool-input
    piece handed to ``deltas`` on the way. An ``error`` event mid-stream is mapped as the same
    error answered with its HTTP status would be."""
    blocks: dict[int, dict[str, Any]] = {}
    pieces: dict[int, list[str]] = {}  # a tool_use block's input, as JSON text in pieces
    calls: dict[int, int] = {}  # block index → the tool call's index among the calls
    usage: dict[str, Any] = {}
    stopped = False
    for data in events:
        event = json.loads(data)
        kind = event.get("type")
        if kind == "content_block_delta":
            _block_piece(event, blocks, pieces, calls, deltas)
        elif kind == "content_block_start":
            index, block = event["index"], dict(event["content_block"])
            blocks[index] = block
            if block.get("type") == "tool_use":
                calls[index] = len(calls)
                pieces[index] = []
                deltas.tool_call(
                    calls[index], call_id=block["id"], name=block["name"], arguments=""
                )
        elif kind == "message_start":
            usage = dict(event["message"].get("usage") or {})
        elif kind == "message_delta":
            usage |= {k: v for k, v in (event.get("usage") or {}).items() if v is not None}
        elif kind == "message_stop":
            stopped = True  # read on to the body's end: the connection is then kept
        elif kind == "error":
            raise stream_error(event.get("error") or {}, response=response)
    if not stopped:
        raise ModelTransientError("the model provider's stream ended before its answer did")
    for index, parts_ in pieces.items():
        raw = "".join(parts_)
        blocks[index]["input"] = parse_arguments(raw)[0] if raw else {}
    return _answer([blocks[index] for index in sorted(blocks)], usage)


def _block_piece(
    event: dict[str, Any],
    blocks: dict[int, dict[str, Any]],
    pieces: dict[int, list[str]],
    calls: dict[int, int],
    deltas: Deltas,
) -> None:
    """One ``content_block_delta``: more text, tool input, thinking or its signature."""
    index, delta = event["index"], event["delta"]
    block, kind = blocks[index], delta.get("type")
    if kind == "text_delta":
        block["text"] = block.get("text", "") + delta["text"]
        deltas.text(delta["text"])
    elif kind == "input_json_delta":
        pieces[index].append(delta["partial_json"])
        if delta["partial_json"]:
            deltas.tool_call(calls[index], call_id="", name="", arguments=delta["partial_json"])
    elif kind == "thinking_delta":
        block["thinking"] = block.get("thinking", "") + delta["thinking"]
    elif kind == "signature_delta":
        block["signature"] = block.get("signature", "") + delta["signature"]


# The HTTP status each of the API's error types comes with, for an error sent mid-stream.
ERROR_STATUSES = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "overloaded_error": 529,
}


def stream_error(error: dict[str, Any], *, response: httpx.Response) -> Exception:
    """An ``error`` event, mapped as its type's HTTP status would be (``map_error``)."""
    status = ERROR_STATUSES.get(str(error.get("type")), 500)
    said = str(error.get("message") or error.get("type") or "error")
    failed = httpx.Response(status, request=response.request, json={"error": error})
    return map_error(anthropic.APIStatusError(said, response=failed, body={"error": error}))


def _answer(content: list[dict[str, Any]], usage: dict[str, Any]) -> ModelResponse:
    """A streamed answer's blocks and usage as Ratchet's response (as ``parse_message``)."""
    text = "".join(block.get("text", "") for block in content if block.get("type") == "text")
    calls = [
        ToolCallRequest(block["id"], block["name"], dict(block.get("input") or {}))
        for block in content
        if block.get("type") == "tool_use"
    ]
    thinking = [block for block in content if block.get("type") in THINKING_BLOCKS]
    cached = int(usage.get("cache_read_input_tokens") or 0)
    written = int(usage.get("cache_creation_input_tokens") or 0)
    details = usage.get("output_tokens_details")
    reasoning = details.get("thinking_tokens") if isinstance(details, dict) else None
    return ModelResponse(
        content=text or None,
        tool_calls=calls,
        input_tokens=int(usage.get("input_tokens") or 0) + cached + written,
        output_tokens=int(usage.get("output_tokens") or 0),
        cached_input_tokens=cached,
        cache_write_tokens=written,
        reasoning_tokens=int(reasoning or 0),
        thinking=thinking,
    )


def parse_message(reply: anthropic.types.Message) -> ModelResponse:
    """A Messages-API answer as Ratchet's response. Anthropic's ``input_tokens`` leaves out the
    tokens read from or written to the cache; Ratchet's is the whole prompt."""
    text = "".join(block.text for block in reply.content if block.type == "text")
    calls = [
        ToolCallRequest(block.id, block.name, dict(block.input))
        for block in reply.content
        if block.type == "tool_use"
    ]
    thinking = [
        block.model_dump(mode="json", exclude_none=True)
        for block in reply.content
        if block.type in THINKING_BLOCKS
    ]
    usage = reply.usage
    cached = usage.cache_read_input_tokens or 0
    written = usage.cache_creation_input_tokens or 0
    details = usage.output_tokens_details
    return ModelResponse(
        content=text or None,
        tool_calls=calls,
        input_tokens=usage.input_tokens + cached + written,
        output_tokens=usage.output_tokens,
        cached_input_tokens=cached,
        cache_write_tokens=written,
        reasoning_tokens=details.thinking_tokens if details is not None else 0,
        thinking=thinking,
    )
