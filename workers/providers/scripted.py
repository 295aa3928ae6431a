"""``scripted``: a deterministic model for tests and demos.

It reads ``model_options.script``; the n-th model call of a task (step n) returns turn n.
A committed model call is never made again, so step n's turn is asked for until it answers.

Given ``Deltas`` it streams, as a real model would: its text a word at a time and each tool
call's JSON arguments a few characters at a time, the turn's ``delay_ms`` spread evenly over
the pieces (a turn that fails waits its delay and fails before any piece).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from functools import partial

from shared.errors import ModelPermanentError, ModelRateLimited, ModelTransientError
from shared.model_strings import Script, ScriptTurn
from shared.settings import get_settings
from workers.providers.base import (
    Deltas,
    ModelRequest,
    ModelResponse,
    ToolCallRequest,
    estimate_tokens,
)
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
        delay_s = min(turn.delay_ms or 0, settings.scripted_max_delay_ms) / 1000
        calls = [
            ToolCallRequest(id=f"call_{request.step}_{i}", name=c.name, arguments=c.arguments)
            for i, c in enumerate(turn.tool_calls)
        ]
        if request.deltas is None or self._failing(request, turn):
            if delay_s:
                time.sleep(delay_s)
            self._maybe_fail(request, turn)
        else:
            stream(turn.content or "", calls, request.deltas, seconds=delay_s)
        output_text = (turn.content or "") + "".join(
            json.dumps(c.arguments) for c in turn.tool_calls
        )
        return ModelResponse(
            content=turn.content,
            tool_calls=calls,
            input_tokens=turn.usage.input_tokens if turn.usage else _prompt_tokens(request),
            output_tokens=turn.usage.output_tokens if turn.usage else estimate_tokens(output_text),
        )

    def _failing(self, request: ModelRequest, turn: ScriptTurn) -> bool:
        """Whether this call of the turn is one that fails."""
        with self._lock:
            return (
                turn.error is not None
                and self._failures.get((request.task_id, request.step), 0) < turn.times
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


WORDS = re.compile(r"\s*\S+\s*|\s+")
ARGUMENT_PIECE = 8  # characters of a tool call's JSON arguments a piece


def stream(content: str, calls: list[ToolCallRequest], deltas: Deltas, *, seconds: float) -> None:
    """Hand ``content`` and ``calls`` to ``deltas`` in pieces, ``seconds`` spread over them;
    a stop ends it at once."""
    pieces: list[Callable[[], None]] = [partial(deltas.text, w) for w in WORDS.findall(content)]
    for index, call in enumerate(calls):
        raw = json.dumps(call.arguments)
        pieces.append(
            partial(deltas.tool_call, index, call_id=call.id, name=call.name, arguments="")
        )
        pieces += [
            partial(
                deltas.tool_call,
                index,
                call_id="",
                name="",
                arguments=raw[at : at + ARGUMENT_PIECE],
            )
            for at in range(0, len(raw), ARGUMENT_PIECE)
        ]
    stop = threading.Event()
    gap = seconds / len(pieces) if pieces else seconds
    with deltas.stopping(stop.set):
        for piece in pieces or [lambda: None]:
            if gap and stop.wait(gap):
                break
            piece()
    if stop.is_set():
        raise ModelTransientError("scripted: the stream was stopped")


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
