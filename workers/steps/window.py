"""The prompt's size, counted before every model call, and the cut that keeps it inside the
model's window: the system prompt and the first user message always, then as many of the most
recent turns as fit, with a short message saying what was left out.

A turn is a step as the model reads it back: its answer (an assistant message, with the tool
calls it asked for) and what followed it (each call's result, and any message the step added).
A turn stays or goes whole, so a tool call is never separated from its result.

Counting: OpenAI models with tiktoken (``workers.tokens``), exact; other models at about four
characters a token, then corrected by what the provider reports it read: each process keeps,
per model, the ratio of the reported ``input_tokens`` to its own estimate of the same prompt,
and scales its estimates by it. The ratio only ever raises an estimate (between 1 and
``MAX_RATIO``): an estimate too high only keeps the prompt further inside the window, one too
low would overflow it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from workers import tokens
from workers.providers.base import Message, ToolSchema, estimate_tokens
from workers.providers.parts import media_tokens, text_of
from workers.tool_runner import cut_text

SUMMARY_KEY = "summary"  # a message that stands for earlier steps says so under this key
MAX_RATIO = 4.0
MIN_CUT_CHARS = 200  # the least of a tool's result the newest turn keeps when it must shrink

PREFIXES_KEPT = 1024  # tasks whose conversation's count a process remembers
_prefixes: OrderedDict[str, tuple[str, int, Message, int]] = OrderedDict()
_prefixes_lock = threading.Lock()
_ratios: dict[str, float] = {}
_ratios_lock = threading.Lock()


class TooLong(Exception):
    """Even the system prompt, the first user message and the newest turn, shortened, do not
    fit the window with room for the answer."""


@dataclass(frozen=True)
class Counter:
    """Counts a prompt's tokens for one model (``provider:name``)."""

    model: str
    count_text: Callable[[str], int]
    exact: bool  # a tokenizer, not an estimate

    @property
    def ratio(self) -> float:
        return 1.0 if self.exact else _ratios.get(self.model, 1.0)

    def message(self, message: Message) -> int:
        count = self.count_text(content_text(message.get("content")))
        count += media_tokens(message.get("content"))
        count += self.count_text(message.get("tool_call_id") or "")
        for call in message.get("tool_calls") or ():
            count += self.count_text(json.dumps(wire_call(call)))
        if message.get("thinking"):  # Anthropic's thinking blocks, sent back with their turn
            count += self.count_text(json.dumps(message["thinking"]))
        return count + tokens.PER_MESSAGE

    def messages(self, messages: Sequence[Message]) -> int:
        raw = sum(self.message(m) for m in messages) + tokens.REPLY_PRIMING
        return _scaled(raw, self.ratio)

    def history(self, task_id: str, messages: Sequence[Message]) -> int:
        """``messages(messages)`` for a task's conversation, counting only what was added
        since this process last counted it (a step that follows another on the same thread
        carries the same message objects on, with its own after them)."""
        with _prefixes_lock:
            seen = _prefixes.get(task_id)
        raw, start = 0, 0
        # The same object where the count stopped: the same messages before it, unchanged.
        if (
            seen is not None
            and seen[0] == self.model
            and 0 < seen[1] <= len(messages)
            and messages[seen[1] - 1] is seen[2]
        ):
            raw, start = seen[3], seen[1]
        raw += sum(self.message(m) for m in messages[start:])
        if messages:
            with _prefixes_lock:
                _prefixes[task_id] = (self.model, len(messages), messages[-1], raw)
                _prefixes.move_to_end(task_id)
                while len(_prefixes) > PREFIXES_KEPT:
                    _prefixes.popitem(last=False)
        return _scaled(raw + tokens.REPLY_PRIMING, self.ratio)

    def tools(self, schemas: Sequence[ToolSchema]) -> int:
        raw = sum(self.count_text(json.dumps(wire_tool(t))) for t in schemas)
        return _scaled(raw, self.ratio)


def wire_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call as the chat-completions wire carries it: counted whole (its id, its
    wrapping and its arguments as a JSON string), a few tokens more than a provider counts."""
    arguments = json.dumps(call.get("arguments") or {})
    function = {"name": call.get("name"), "arguments": arguments}
    return {"id": call.get("id"), "type": "function", "function": function}


def wire_tool(tool: ToolSchema) -> dict[str, Any]:
    """A tool's definition as the chat-completions wire carries it (counted whole, too)."""
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


def counter_for(model: str) -> Counter:
    """The counter of ``model``: its tokenizer if it has one, else the estimate."""
    encoding = tokens.encoding_for(model)
    if encoding is None:
        return Counter(model, estimate_tokens, exact=False)
    return Counter(model, tokens.text_counter(model), exact=True)


def observe(model: str, *, counted: int, reported: int) -> None:
    """Correct the estimates of ``model`` by what the provider said it read of a prompt this
    process counted as ``counted`` (a tokenizer's count is not corrected, nor the scripted
    model's, whose usage is whatever its script says)."""
    if reported <= 0 or counted <= 0 or model == "scripted" or tokens.encoding_for(model):
        return
    seen = min(MAX_RATIO, max(1.0, reported / (counted / _ratios.get(model, 1.0))))
    with _ratios_lock:
        old = _ratios.get(model, 1.0)
        # Up at once (an overflow costs a failed call), down slowly (a short prompt says less).
        _ratios[model] = seen if seen > old else old * 0.8 + seen * 0.2


def _scaled(count: int, ratio: float) -> int:
    return count if ratio == 1.0 else int(count * ratio) + 1


def content_text(content: Any) -> str:
    """A message's text: its content, or the text of its parts (its images and files are
    counted by ``parts.media_tokens``)."""
    return text_of(content)


@dataclass(frozen=True)
class Conversation:
    """A history as the window sees it: what is always kept (``head``: the system prompt,
    the first user message and the summary standing for earlier steps, if any), and the
    units that may be left out, oldest first: the rest of the task's input, one message each,
    then the turns, from step ``first_step`` on."""

    head: list[Message]
    units: list[list[Message]]
    inputs: int  # how many of the units are input messages (the rest are turns)
    first_step: int

    @property
    def turns(self) -> list[list[Message]]:
        return self.units[self.inputs :]


def split(history: list[Message], *, opening: int) -> Conversation:
    """Split ``history``, whose first ``opening`` messages are the task's system prompt and
    input (``context.open_conversation``)."""
    first_user = next((i for i in range(opening) if history[i]["role"] == "user"), opening - 1)
    head, inputs = list(history[: first_user + 1]), [[m] for m in history[first_user + 1 : opening]]
    rest = history[opening:]
    first_step = 1
    if rest and SUMMARY_KEY in rest[0]:
        head.append(rest[0])
        first_step = int(rest[0][SUMMARY_KEY]["through_step"]) + 1
        rest = rest[1:]
    turns: list[list[Message]] = []
    for message in rest:
        if message["role"] == "assistant" or not turns:
            turns.append([message])
        else:
            turns[-1].append(message)
    return Conversation(head, inputs + turns, len(inputs), first_step)


def summary_message(*, number: int, through_step: int, content: str) -> Message:
    """The message that stands for steps 1..``through_step`` in the prompt."""
    text = (
        f"[Summary of this conversation through step {through_step}, which replaces those "
        f"turns here to fit the model's context window]\n{content}"
    )
    return {
        "role": "user",
        "content": text,
        SUMMARY_KEY: {"number": number, "through_step": through_step},
    }


def left_out_message(conversation: Conversation, dropped: int) -> Message:
    """The marker that says what the cut left out (``dropped`` units, oldest first)."""
    inputs = min(dropped, conversation.inputs)
    turns = dropped - inputs
    messages = sum(len(u) for u in conversation.units[:dropped])
    what = [f"{messages} earlier message{'s' * (messages != 1)}"]
    if turns:
        first = conversation.first_step
        last = first + turns - 1
        what.append(f"the turns of step {first}" + (f" to step {last}" if last > first else ""))
    text = " (".join(what) + ")" * (len(what) - 1)
    return {
        "role": "user",
        "content": f"[{text} left out here to fit the model's context window]",
    }


@dataclass(frozen=True)
class Cut:
    """The prompt that fits: its messages, their tokens, and how many units were left out."""

    messages: list[Message]
    tokens: int
    dropped: int


def truncate(conversation: Conversation, *, budget: int, counter: Counter) -> Cut:
    """The head, then the newest units that fit in ``budget`` tokens after a marker saying what
    was left out; if the newest unit alone does not fit, its tool results are shortened."""
    units = conversation.units
    fixed = counter.messages(conversation.head)
    if units:
        fixed += counter.messages([left_out_message(conversation, len(units))])
    sizes = [counter.messages(u) - tokens.REPLY_PRIMING for u in units]
    kept, used = 0, fixed
    while kept < len(units) and used + sizes[-1 - kept] <= budget:
        used += sizes[-1 - kept]
        kept += 1
    dropped = len(units) - kept
    newest: list[list[Message]] = [list(u) for u in units[dropped:]]
    if not newest and units:  # the newest unit alone is too large: shorten it
        newest = [shorten(units[-1], room=budget - fixed, counter=counter)]
        dropped = len(units) - 1
    if fixed > budget and not units:
        raise TooLong(f"the prompt alone has {fixed} tokens")
    marker = [left_out_message(conversation, dropped)] if dropped else []
    messages = conversation.head + marker + [m for u in newest for m in u]
    return Cut(messages, counter.messages(messages), dropped)


def shorten(unit: list[Message], *, room: int, counter: Counter) -> list[Message]:
    """``unit`` with its results (every message but the answer) cut until it fits in ``room``
    tokens; raises TooLong when even the least of them does not fit."""
    answer = [m for m in unit if m["role"] == "assistant"]
    if counter.messages(answer) - tokens.REPLY_PRIMING > room:
        raise TooLong("the newest answer alone does not fit")
    results = [m for m in unit if m["role"] != "assistant"]
    longest = max((len(content_text(m.get("content"))) for m in results), default=0)
    limit = longest
    while limit >= MIN_CUT_CHARS:
        cut = [_cut_message(m, limit) for m in unit]
        if counter.messages(cut) - tokens.REPLY_PRIMING <= room:
            return cut
        limit //= 2
    raise TooLong("the newest turn does not fit, even with its results cut short")


def _cut_message(message: Message, limit: int) -> Message:
    content = message.get("content")
    if message["role"] == "assistant" or not isinstance(content, str):
        return message
    return message | {"content": cut_text(content, limit)}
