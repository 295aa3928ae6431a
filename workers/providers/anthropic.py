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
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import anthropic

from shared.settings import get_settings
from workers.providers import parts, structured
from workers.providers.base import (
    Message,
    ModelRequest,
    ModelResponse,
    Sharded,
    ToolCallRequest,
    answer_cap,
    classify_error,
    local_names,
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
