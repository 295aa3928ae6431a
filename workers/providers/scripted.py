"""``scripted``: a deterministic model for tests and demos.

It reads ``model_options.script``; the n-th model call of a task (step n) returns turn n.
A committed model call is never made again, so step n's turn is asked for until it answers.
"""

from __future__ import annotations

import json
import threading
import time

from shared.errors import ModelPermanentError, ModelRateLimited, ModelTransientError
from shared.model_strings import Script, ScriptTurn
from shared.settings import get_settings
from workers.providers.base import ModelRequest, ModelResponse, ToolCallRequest, estimate_tokens
from workers.providers.parts import estimated_tokens


class ScriptedProvider:
    def __init__(self) -> None:
        # Failures injected so far per (task, step). In memory: a restarted worker starts the
        # count again, which only makes an `error` turn fail a few more times.
        self._failures: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def complete(self, request: ModelRequest) -> ModelResponse:
        settings = get_settings()
        if not settings.scripted_model:
            # Submission refuses it; a task accepted while it was on fails here, cleanly.
            raise ModelPermanentError("the scripted model is off (RATCHET_SCRIPTED_MODEL)")
        if request.purpose == "summary":
            return _summary(request)
        turns = Script.model_validate(request.options).script
        if request.step > len(turns):
            return self._past_the_end(request)
        turn = turns[request.step - 1]
        if turn.delay_ms:
            time.sleep(min(turn.delay_ms, settings.scripted_max_delay_ms) / 1000)
        self._maybe_fail(request, turn)
        calls = [
            ToolCallRequest(id=f"call_{request.step}_{i}", name=c.name, arguments=c.arguments)
            for i, c in enumerate(turn.tool_calls)
        ]
        output_text = (turn.content or "") + "".join(
            json.dumps(c.arguments) for c in turn.tool_calls
        )
        return ModelResponse(
            content=turn.content,
            tool_calls=calls,
            input_tokens=turn.usage.input_tokens if turn.usage else _prompt_tokens(request),
            output_tokens=turn.usage.output_tokens if turn.usage else estimate_tokens(output_text),
        )

    def _maybe_fail(self, request: ModelRequest, turn: ScriptTurn) -> None:
        if turn.error is None:
            return
        key = (request.task_id, request.step)
        with self._lock:
            failed = self._failures.get(key, 0)
            if failed >= turn.times:
                return
            self._failures[key] = failed + 1
        if turn.error == "rate_limit":
            raise ModelRateLimited("scripted: rate limited (429)", retry_after=1.0)
        if turn.error == "timeout":
            raise ModelTransientError("scripted: the model call timed out")
        raise ModelTransientError("scripted: server error (500)")

    def _past_the_end(self, request: ModelRequest) -> ModelResponse:
        last_tool = next((m for m in reversed(request.messages) if m["role"] == "tool"), None)
        content = str(last_tool["content"]) if last_tool else "Done."
        return ModelResponse(
            content=content,
            input_tokens=_prompt_tokens(request),
            output_tokens=estimate_tokens(content),
        )


def _summary(request: ModelRequest) -> ModelResponse:
    """A summary as the scripted model writes one: the start of what it was given (the same
    prompt, the same summary)."""
    text = str(request.messages[-1].get("content") or "") if request.messages else ""
    content = "Scripted summary: " + " ".join(text.split())[:SUMMARY_CHARS]
    return ModelResponse(
        content=content,
        input_tokens=_prompt_tokens(request),
        output_tokens=estimate_tokens(content),
    )


SUMMARY_CHARS = 400


def _prompt_tokens(request: ModelRequest) -> int:
    return sum(estimated_tokens(m.get("content")) for m in request.messages)
