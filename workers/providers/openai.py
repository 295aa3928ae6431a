"""``openai:<model>``: any OpenAI-compatible chat-completions endpoint, via the official SDK.

The SDK's own retries are off: Ratchet decides about retries, so it can count them, honour
``Retry-After`` and send long waits back through the queue.
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any

import httpx
import openai

from shared.errors import ModelPermanentError
from shared.settings import get_settings
from workers.providers import parts, structured
from workers.providers.base import (
    Message,
    ModelRequest,
    ModelResponse,
    Sharded,
    ToolCallRequest,
    classify_error,
    local_names,
    parse_arguments,
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
