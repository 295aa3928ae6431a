"""A task's final answer against its output schema.

A final answer (no tool calls) of a task with an ``output_schema`` must be JSON that meets
it. One that does not is still checkpointed, as the step's answer, with what is wrong with
it (``output_error``); the step completes like any other, and the model reads that error back
as a user message right after its answer, so the next step is its next try. A crash anywhere
in between resumes as any step does: the committed answer and its verdict are never asked for
or judged again. Past ``RATCHET_OUTPUT_RETRIES`` such tries the task fails with
``invalid_output``. The answer that meets the schema ends the task with the parsed JSON
value as ``result.output``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from shared.output_schema import problem
from shared.settings import get_settings
from shared.views import TaskState
from workers.providers import ModelResponse
from workers.providers.base import Message

FEEDBACK = (
    "Your final answer must be a JSON value that meets the required output schema, and it is "
    "not: {error}. Answer again with the corrected JSON value alone."
)


def review(task: TaskState, response: ModelResponse) -> ModelResponse:
    """``response`` as checkpointed: a final answer that misses the task's output schema
    carries what is wrong with it (``output_error``)."""
    schema = task.output_schema
    if schema is None or response.tool_calls:
        return response
    _, error = problem(schema, response.content)
    return response if error is None else replace(response, output_error=error)


def failure(response: ModelResponse, history: Sequence[Message]) -> str | None:
    """Why the task fails with this answer (``invalid_output``): it misses the schema, and
    the answers before it used every try (``RATCHET_OUTPUT_RETRIES``). None: it may go on."""
    if response.output_error is None:
        return None
    used = tries_used(history)
    if used < get_settings().output_retries:
        return None
    tries = f"after {used} {'retry' if used == 1 else 'retries'}" if used else "with no retries"
    return f"the final answer does not meet the output schema {tries}: {response.output_error}"


def tries_used(history: Sequence[Message]) -> int:
    """How many answers of this task went back to the model for missing its schema."""
    return sum(1 for message in history if message.get("output_error") is not None)


def feedback(answer: Mapping[str, Any]) -> list[Message]:
    """What the model reads after a checkpointed answer (``ModelResponse.to_dict``): the
    error, if the answer missed the output schema; nothing otherwise."""
    error = answer.get("output_error")
    if error is None:
        return []
    return [{"role": "user", "content": FEEDBACK.format(error=error), "output_error": error}]


def result_output(task: TaskState, content: str | None) -> Any:
    """``result.output``: the answer's text, or, with an output schema, its parsed JSON."""
    if task.output_schema is None:
        return content or ""
    return json.loads(content or "")
