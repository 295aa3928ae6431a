"""A model, for the OpenAI-compatible test server, that reads the test book one page a step
(the ``reader`` agent's ``read_page`` tool, ``tests/sample_agents.py``) and measures every
prompt it is sent.

The next page is the one after the last page read in the prompt, so the answer depends only
on the conversation's newest turn: it reads on whatever was cut or summarized before it.
A request whose system prompt is the summarizer's gets a summary. Every prompt's size is
counted with tiktoken's ``cl100k_base`` the way OpenAI counts chat messages (every string of
each message, a few tokens around each, and the tools' definitions) and recorded::

    reader = Reader(last_page=199)
    with OpenAIServer(responder=reader) as server: ...
    assert max(reader.sizes) <= window
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from tests.fakes.openai_server import Call, Completion, Received, Reply, answer

PAGE = re.compile(r"page(\d+)-word0 ")
SUMMARIZER = "You compress"


def prompt_tokens(body: dict[str, Any]) -> int:
    """The request's prompt in tokens, counted as OpenAI's cookbook counts chat messages."""
    from workers.tokens import bundled

    encoding = bundled()

    def count(value: Any) -> int:
        return len(encoding.encode_ordinary(value if isinstance(value, str) else json.dumps(value)))

    total = 3
    for message in body["messages"]:
        total += 3 + sum(count(v) for k, v in message.items() if v is not None)
    for tool in body.get("tools") or ():
        total += count(tool["function"])
    return total


@dataclass
class Reader:
    """The responder; ``sizes`` holds each step's prompt size, ``summary_sizes`` each
    summarizing call's, in the order they came."""

    last_page: int
    sizes: list[int] = field(default_factory=list)
    summary_sizes: list[int] = field(default_factory=list)
    summary_prompts: list[list[dict[str, Any]]] = field(default_factory=list)
    prompts: list[list[dict[str, Any]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, request: Received) -> Reply:
        size = prompt_tokens(request.body)
        messages = request.messages
        if str(messages[0].get("content", "")).startswith(SUMMARIZER):
            with self.lock:
                self.summary_sizes.append(size)
                self.summary_prompts.append(messages)
                number = len(self.summary_sizes)
            return answer(f"Summary {number}: the agent is reading the book.", prompt_tokens=size)
        with self.lock:
            self.sizes.append(size)
            self.prompts.append(messages)
        page = self.next_page(messages)
        if page > self.last_page:
            return answer(f"I read {self.last_page} pages.", prompt_tokens=size)
        call = Call("read_page", {"number": page}, id=f"call_page_{page}")
        return Completion(calls=(call,), prompt_tokens=size, completion_tokens=12)

    @staticmethod
    def next_page(messages: list[dict[str, Any]]) -> int:
        for message in reversed(messages):
            if message["role"] == "tool":
                found = PAGE.search(str(message.get("content")))
                return int(found.group(1)) + 1 if found else 1
        return 1


def unpaired_calls(messages: list[dict[str, Any]]) -> list[str]:
    """Tool results without the assistant message that asked for them just before, and tool
    calls without their results just after (on the OpenAI wire format)."""
    problems: list[str] = []
    asked: set[str] = set()
    for message in messages:
        if message["role"] == "tool":
            if message["tool_call_id"] not in asked:
                problems.append(f"result {message['tool_call_id']} without its call")
            asked.discard(message["tool_call_id"])
            continue
        problems += [f"call {call_id} without its result" for call_id in sorted(asked)]
        asked = {c["id"] for c in message.get("tool_calls") or ()}
    return problems + [f"call {call_id} without its result" for call_id in sorted(asked)]
