"""The ``summarize`` context policy: older turns compressed into a summary by a model call,
committed before the step's own model call uses it.

A summary is written once: its row commits in a fenced write of its own (with its tokens and
cost added to the task's usage, so they count against the budget), and a step that runs again
after a crash reads it back with the history (``context.load_context``) instead of asking for
it again. Summary ``n`` builds on summary ``n - 1``: the model is given the one before and the
turns after it, and writes one that covers them all.

Which turns: the oldest, leaving the newest verbatim in at most ``KEEP_SHARE`` of the prompt's
budget (so the next summary is due only after the conversation has grown by as much again),
and no more at once than the summarizing model's own window takes (the rest wait for the next
summary, made at once, up to ``MAX_SUMMARIES_PER_STEP``).
"""

from __future__ import annotations

import json
import logging
from functools import partial

from shared import failpoints
from shared.context_window import ContextPolicy, context_window
from shared.pricing import cost_usd
from shared.settings import get_settings
from shared.store import summaries
from shared.store.step_write import add_usage
from workers import heartbeat, model_calls
from workers.providers import ModelRequest, ModelResponse, get_provider
from workers.providers.base import Message
from workers.steps import window
from workers.steps.commits import fenced
from workers.steps.context import Context
from workers.tool_runner import cut_text, storable_text

log = logging.getLogger("ratchet.step")

KEEP_SHARE = 0.5
MAX_SUMMARIES_PER_STEP = 8
TASK_CHARS = 4_000  # of the task's first message, shown to the summarizing model

INSTRUCTIONS = (
    "You compress the earlier part of an AI agent's conversation so that the agent can carry "
    "on without it. Keep every fact, number, name, identifier, decision, tool result and open "
    "question that the rest of the task may need; drop pleasantries and repetition. Write "
    "plain text, no more than about {words} words."
)


def compress(
    ctx: Context, *, opening: int, budget: int, counter: window.Counter, policy: ContextPolicy
) -> None:
    """Summarize the oldest turns of ``ctx.history`` (whose first ``opening`` messages are the
    task's own) until it fits in ``budget`` tokens or only the newest turn is left; each
    summary commits before the next is made, and ``ctx.history`` then holds it."""
    for _ in range(MAX_SUMMARIES_PER_STEP):
        if counter.history(ctx.task.id, ctx.history) <= budget:
            return
        conversation = window.split(ctx.history, opening=opening)
        turns = conversation.turns
        if len(turns) < 2:
            return  # only the newest turn is left: the cut shortens it
        count = _turns_to_compress(turns, budget=budget, counter=counter)
        summary = summarize(ctx, conversation, count=count, policy=policy)
        commit(ctx, summary)
        # The turns after the summary's last step (the summarizing model's window may have
        # taken fewer than ``count``: the rest wait for the next summary).
        covered = summary.through_step - conversation.first_step + 1
        kept = [m for turn in turns[covered:] for m in turn]
        message = window.summary_message(
            number=summary.number, through_step=summary.through_step, content=summary.content
        )
        ctx.history = [*ctx.history[:opening], message, *kept]


def _turns_to_compress(turns: list[list[Message]], *, budget: int, counter: window.Counter) -> int:
    """How many of the oldest turns to compress: all but the newest that fit in
    ``KEEP_SHARE`` of the budget (the newest always stays)."""
    room, kept = budget * KEEP_SHARE, 0
    for turn in reversed(turns[1:]):
        room -= counter.messages(turn)
        if room < 0:
            break
        kept += 1
    return len(turns) - 1 - kept


def summarize(
    ctx: Context, conversation: window.Conversation, *, count: int, policy: ContextPolicy
) -> summaries.NewSummary:
    """Ask the policy's model (else the task's) for a summary of the summary so far and the
    oldest ``count`` turns, as many of them as its window takes (at least one)."""
    settings = get_settings()
    model = policy.model or ctx.task.model
    previous = _previous(conversation)
    first = conversation.first_step
    room = settings.summary_max_tokens
    counter = window.counter_for(model)
    budget = context_window(model, settings) - room
    task_text = cut_text(window.content_text(_first_user(conversation).get("content")), TASK_CHARS)
    fixed = counter.messages(
        _prompt(task_text, previous[1], "", first=first, last=first, room=room)
    )
    transcript, last = _transcript(
        conversation.turns[:count], first_step=first, room=budget - fixed, counter=counter
    )
    messages = _prompt(task_text, previous[1], transcript, first=first, last=last, room=room)
    response = _ask(ctx, model, messages, room)
    content = (response.content or "").strip() or "(the summary came back empty)"
    cost = cost_usd(model, input_tokens=response.input_tokens, output_tokens=response.output_tokens)
    log.info("summary %d of %s covers steps 1-%d", previous[0] + 1, ctx.task.id, last)
    return summaries.NewSummary(
        number=previous[0] + 1,
        through_step=last,
        content=storable_text(content),
        model=model,
        input_tokens=response.input_tokens,
        output_tokens=response.output_tokens,
        cost_usd=cost or 0.0,
    )


def commit(ctx: Context, summary: summaries.NewSummary) -> None:
    """The summary's row and its usage, in one fenced write: only this lease's holder writes
    it, and once it is committed no run of this step asks for it again."""
    with fenced(ctx) as writes:
        writes.set(
            add_usage(
                input_tokens=summary.input_tokens,
                output_tokens=summary.output_tokens,
                cost_usd=summary.cost_usd,
            )
        )
        writes.add(summaries.save_summary(ctx.lease, summary))
    failpoints.hit("after_summary_commit")


def _previous(conversation: window.Conversation) -> tuple[int, str]:
    """The number and text of the summary the new one builds on (0 and "" for none)."""
    for message in conversation.head:
        if window.SUMMARY_KEY in message:
            number = int(message[window.SUMMARY_KEY]["number"])
            return number, str(message["content"]).partition("\n")[2]
    return 0, ""


def _first_user(conversation: window.Conversation) -> Message:
    return next((m for m in conversation.head if m["role"] == "user"), {"content": ""})


def _prompt(
    task: str, previous: str, transcript: str, *, first: int, last: int, room: int
) -> list[Message]:
    parts = [f"The agent's task:\n{task}"]
    if previous:
        parts.append(f"The summary so far (of step 1 to step {first - 1}):\n{previous}")
    parts.append(f"The conversation to add (step {first} to step {last}):\n{transcript}")
    parts.append(f"Write the new summary, of everything through step {last}.")
    return [
        {"role": "system", "content": INSTRUCTIONS.format(words=max(50, room * 3 // 5))},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def _transcript(
    turns: list[list[Message]], *, first_step: int, room: int, counter: window.Counter
) -> tuple[str, int]:
    """The turns as text, as many as fit in ``room`` tokens (the first one cut short if it
    alone does not), and the step of the last one."""
    lines: list[str] = []
    last = first_step
    for offset, turn in enumerate(turns):
        text = _render(turn, step=first_step + offset)
        if lines and counter.count_text("\n".join([*lines, text])) > room:
            break
        if not lines and counter.count_text(text) > room:
            text = cut_text(text, max(window.MIN_CUT_CHARS, room * 3))
        lines.append(text)
        last = first_step + offset
    return "\n".join(lines), last


def _render(turn: list[Message], *, step: int) -> str:
    lines = []
    for message in turn:
        text = window.content_text(message.get("content"))
        if message["role"] == "assistant":
            if text:
                lines.append(f"[step {step}] assistant: {text}")
            for call in message.get("tool_calls") or ():
                arguments = json.dumps(call.get("arguments") or {})
                lines.append(f"[step {step}] assistant called {call.get('name')}({arguments})")
        elif message["role"] == "tool":
            lines.append(f"[step {step}] result of {message.get('name')}: {text}")
        else:
            lines.append(f"[step {step}] {message['role']}: {text}")
    return "\n".join(lines)


def _ask(ctx: Context, model: str, messages: list[Message], room: int) -> ModelResponse:
    """The summarizing model's answer (rate limits and retries as for a step's call); its
    errors end the step as the step's own call's would (``model.prompt_of``)."""
    provider, name = get_provider(model)
    request = ModelRequest(
        task_id=ctx.task.id,
        step=ctx.lease.step,
        model=name,
        messages=messages,
        tools=[],
        options={"max_tokens": room},
        purpose="summary",
    )
    return model_calls.complete(
        provider,
        request,
        model=model,
        tenant=ctx.tenant_name,
        prior_failures=ctx.task.model_failures,
        still_held=partial(heartbeat.holding, ctx.lease),
    )
