"""The prompt a step's model call sends: the task's conversation, kept inside the model's
context window, with room for the answer, by the task's context policy.

Counted before every call (``workers.steps.window``). A conversation that fits is sent whole.
One that does not is, by policy: ``summarize``d (older turns replaced by a committed summary,
``workers.steps.summarizer``), then cut if it still does not fit; ``truncate``d (the system
prompt, the first user message, the newest turns and a marker saying what was left out); or,
under ``off``, refused with ``context_length_exceeded`` rather than sent for the provider to
refuse.

Only a summary changes the conversation the next step carries over (``ctx.history``): it is
committed, and a step that reads the history back from the store finds it there too. A cut is
made afresh for each call, from the whole conversation.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.context_window import Policy, answer_room, context_window, policy_of
from shared.settings import get_settings
from workers.providers.base import Message, ToolSchema
from workers.steps import summarizer, window
from workers.steps.context import Context, opening_length, reads_earlier_turns


class ContextExceeded(Exception):
    """The prompt cannot be kept inside the model's window (the message says why)."""


@dataclass(frozen=True)
class Prompt:
    """What the call sends, and its size in tokens as counted before the call (the tools'
    definitions included)."""

    messages: list[Message]
    tokens: int


def prompt_for(ctx: Context, tools: list[ToolSchema]) -> Prompt:
    """The messages this step's model call sends, inside the window of the task's model;
    raises ContextExceeded when its policy cannot keep them there."""
    settings = get_settings()
    task = ctx.task
    policy = policy_of(task.context, settings)
    size = context_window(task.model, settings)
    room = answer_room(policy, task.model_options, window=size, settings=settings)
    counter = window.counter_for(task.model)
    tool_tokens = counter.tools(tools)
    budget = size - room - tool_tokens
    tokens = counter.history(task.id, ctx.history)
    if tokens <= budget:
        return Prompt(ctx.history, tokens + tool_tokens)
    if policy.policy is Policy.OFF:
        raise ContextExceeded(
            f"the prompt has {tokens + tool_tokens} tokens, and with {room} kept for the "
            f"answer the context window of {task.model} ({size} tokens) holds "
            f"{size - room}; the task's context policy is off (truncate or summarize would "
            "keep it inside the window)"
        )
    opening = opening_length(task, ctx.agent)
    # A summary stands for this task's own steps (its ``through_step``): a thread's later turn,
    # whose history holds earlier turns' steps too, is cut instead.
    if policy.policy is Policy.SUMMARIZE and not reads_earlier_turns(task):
        summarizer.compress(ctx, opening=opening, budget=budget, counter=counter, policy=policy)
        tokens = counter.history(task.id, ctx.history)
        if tokens <= budget:
            return Prompt(ctx.history, tokens + tool_tokens)
    try:
        cut = window.truncate(
            window.split(ctx.history, opening=opening), budget=budget, counter=counter
        )
    except window.TooLong as exc:
        raise ContextExceeded(
            f"{exc}: the context window of {task.model} ({size} tokens, {room} of them kept "
            "for the answer) cannot hold the system prompt, the first user message and the "
            "newest turn"
        ) from exc
    return Prompt(cut.messages, cut.tokens + tool_tokens)
