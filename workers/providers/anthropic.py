"""``anthropic:<model>``: the Messages API via the official SDK, its own retries off."""

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
    classify_error,
    tls_context,
)

PASSED_OPTIONS = ("temperature", "top_p", "top_k", "stop_sequences", "tool_choice")
DEFAULT_MAX_TOKENS = 4096


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
            blocks: list[dict[str, Any]] = []
            if message.get("content"):
                blocks.append({"type": "text", "text": message["content"]})
            for call in message.get("tool_calls") or []:
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": call["name"],
                        "input": call["arguments"],
                    }
                )
            wire.append({"role": "assistant", "content": blocks})
        else:
            wire.append({"role": "user", "content": parts.to_anthropic(message.get("content"))})
    return system, wire


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
        if system:
            options["system"] = system
        tools = [
            {"name": t.name, "description": t.description, "input_schema": t.parameters}
            for t in request.tools
        ]
        output = structured.for_anthropic(request, tools, options)
        if tools:
            options["tools"] = tools
        try:
            reply = self.client.messages.create(
                model=request.model,
                max_tokens=int(request.options.get("max_tokens", DEFAULT_MAX_TOKENS)),
                messages=messages,  # type: ignore[arg-type]
                **options,
            )
        except anthropic.AnthropicError as exc:
            raise map_error(exc) from exc
        text = "".join(block.text for block in reply.content if block.type == "text")
        calls = [
            ToolCallRequest(block.id, block.name, dict(block.input))
            for block in reply.content
            if block.type == "tool_use"
        ]
        response = ModelResponse(
            content=text or None,
            tool_calls=calls,
            input_tokens=reply.usage.input_tokens,
            output_tokens=reply.usage.output_tokens,
        )
        return response if output is None else output.answer(response)
