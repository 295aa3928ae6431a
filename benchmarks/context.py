"""``ratchet bench context``: the prompt tokens a long task sends, step by step, under each
context policy.

One task per policy, each step a tool call that reads a page of some 300 tokens, then an
answer: ``off`` with a window that holds the whole conversation (every prompt resends all of
it, so the total grows with the square of the steps), ``truncate`` and ``summarize`` with a
small window (each prompt stays inside it, so the total grows linearly), and ``off`` with the
small window too, which ends with ``context_length_exceeded`` at the step that would overflow.

The model is an OpenAI-compatible stub in this process that counts every prompt it is sent,
as OpenAI counts chat messages (tiktoken's ``cl100k_base``: every string of each message, a
few tokens around each, and the tools' definitions), and answers at once: a summarizing call
with a short summary, a step with the next page's tool call. The steps run in this process
on the configured, migrated database (``ratchet migrate``), each carrying its conversation to
the next, as a worker runs a task's steps on one thread.

``--csv PATH`` writes the curves: per step, each policy's prompt and its running total (the
summarizing calls' prompts included, in the step they were made for).
"""

from __future__ import annotations

import json
import os
import re
import threading
from csv import DictWriter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import typer

from benchmarks import plots
from benchmarks.harness.common import bench_tenant, drop_tenant, emit, host

SMALL, LARGE = "openai:bench-small", "openai:bench-large"
PAGE_WORDS = 60  # some 300 tokens a page
TOOL = "bench_read_page"
PAGE = re.compile(r"page(\d+)-word0 ")
SUMMARIZER = "You compress"
POLICIES = (("off", LARGE), ("truncate", SMALL), ("summarize", SMALL), ("off", SMALL))


@dataclass
class Sent:
    """What the stub was sent for one task: each step's prompt, and each summary's."""

    steps: list[int] = field(default_factory=list)
    summaries: dict[int, list[int]] = field(default_factory=dict)  # by the step they preceded


class Stub:
    """The model: reads the book a page a step, and counts every prompt by task."""

    def __init__(self, last_page: int) -> None:
        from workers.tokens import bundled

        self.last_page = last_page
        self.encoding = bundled()
        self.sent: dict[str, Sent] = {}
        self.lock = threading.Lock()

    def tokens(self, body: dict[str, Any]) -> int:
        def count(value: Any) -> int:
            text = value if isinstance(value, str) else json.dumps(value)
            return len(self.encoding.encode_ordinary(text))

        total = 3 + sum(
            3 + sum(count(v) for v in m.values() if v is not None) for m in body["messages"]
        )
        return total + sum(count(t["function"]) for t in body.get("tools") or ())

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        size, messages = self.tokens(body), body["messages"]
        task = re.search(r"\[task (\w+)\]", json.dumps(messages[:3]))
        sent = self.sent.setdefault(task.group(1) if task else "?", Sent())
        if str(messages[0].get("content", "")).startswith(SUMMARIZER):
            with self.lock:
                sent.summaries.setdefault(len(sent.steps) + 1, []).append(size)
            return _completion("Summary: the reader has read the pages so far.", None, size)
        with self.lock:
            sent.steps.append(size)
        page = _next_page(messages)
        if page > self.last_page:
            return _completion(f"I read {self.last_page} pages.", None, size)
        call: dict[str, Any] = {"id": f"call_{page}", "type": "function"}
        call["function"] = {"name": TOOL, "arguments": json.dumps({"number": page})}
        return _completion(None, call, size)


def _next_page(messages: list[dict[str, Any]]) -> int:
    for message in reversed(messages):
        if message["role"] == "tool":
            found = PAGE.search(str(message.get("content")))
            return int(found.group(1)) + 1 if found else 1
    return 1


def _completion(content: str | None, call: dict[str, Any] | None, size: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if call is not None:
        message["tool_calls"] = [call]
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if call else "stop"}
    usage = {"prompt_tokens": size, "completion_tokens": 12, "total_tokens": size + 12}
    return {"id": "bench", "object": "chat.completion", "choices": [choice], "usage": usage}


def _serve(stub: Stub) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            data = json.dumps(stub.answer(json.loads(self.rfile.read(length)))).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _register_tool() -> None:
    from shared.agents.registry import get_registry, tool

    get_registry()

    @tool(name=TOOL, idempotent=True)
    def read_page(number: int) -> str:
        """Read page ``number`` of the book."""
        return " ".join(f"page{number}-word{i}" for i in range(PAGE_WORDS))


def _configure(server: ThreadingHTTPServer, *, small: int, large: int) -> None:
    from shared.queue import get_celery
    from shared.settings import get_settings
    from shared.store.db import require_migrated
    from workers.providers import _provider

    host_, port = server.server_address[:2]
    os.environ.update(
        {
            "RATCHET_BROKER_URL": "memory://localhost/",
            "RATCHET_OPENAI_BASE_URL": f"http://{host_!s}:{port}/v1",
            "RATCHET_OPENAI_API_KEY": "bench",
            "RATCHET_MODEL_CONTEXT_WINDOWS": json.dumps({SMALL: small, LARGE: large}),
        }
    )
    get_settings.cache_clear()
    get_celery.cache_clear()
    _provider.cache_clear()
    require_migrated()


def _run(tenant_id: str, label: str, policy: str, model: str, steps: int) -> dict[str, Any]:
    """One task of ``steps`` steps under ``policy``, its steps on this thread; its outcome."""
    from shared.store.db import transaction
    from shared.store.tables import Task
    from shared.store.tasks import NewTask, create_task
    from workers.steps.runner import advance

    spec = NewTask(
        agent="default",
        model=model,
        input=f"[task {label}] Read the book, one page at a time.",
        instructions=None,
        tools=[TOOL],
        model_options={},
        max_steps=steps + 1,
        budget=None,
        webhook=None,
        metadata={},
        context={"policy": policy},
    )
    with transaction() as session:
        task_id = create_task(session, tenant_id, spec).task.id
    advance(task_id, 1, go_on=lambda: True)
    with transaction() as session:
        task = session.get(Task, task_id)
        assert task is not None
        return {"status": task.status, "steps": task.steps, "error": task.error}


def _curves(sent: dict[str, Sent], labels: list[str], steps: int) -> list[dict[str, Any]]:
    rows, totals = [], dict.fromkeys(labels, 0)
    for number in range(1, steps + 2):
        row: dict[str, Any] = {"step": number}
        for label in labels:
            run = sent.get(label, Sent())
            prompt = run.steps[number - 1] if number <= len(run.steps) else None
            if prompt is not None:
                totals[label] += prompt + sum(run.summaries.get(number, []))
            row[f"{label}_prompt"] = prompt
            row[f"{label}_total"] = totals[label] if prompt is not None else None
        rows.append(row)
    return rows


def _report(
    sent: dict[str, Sent], outcomes: dict[str, Any], rows: list[dict[str, Any]]
) -> dict[str, Any]:
    at = {n: rows[n - 1] for n in (50, 100, 200) if n <= len(rows)}
    return {
        "host": host(),
        "tasks": {
            label: {
                **outcome,
                "largest_prompt": max(sent[label].steps, default=0),
                "summaries": sum(len(v) for v in sent[label].summaries.values()),
                "total_prompt_tokens": {n: row[f"{label}_total"] for n, row in at.items()},
            }
            for label, outcome in outcomes.items()
        },
    }


def context(
    *,
    steps: int = typer.Option(200, help="steps per task (a page each, then the answer)"),
    window: int = typer.Option(8_000, help="the small model's context window, in tokens"),
    csv: str = typer.Option("", help="write the curves to this CSV file"),
    plot: str = typer.Option("", help="draw the curves to this PNG file (needs matplotlib)"),
) -> None:
    """Prompt tokens against steps under off, truncate and summarize (see the module)."""
    stub = Stub(last_page=steps - 1)
    server = _serve(stub)
    _configure(server, small=window, large=max(window, 100 * steps * PAGE_WORDS))
    _register_tool()
    tenant_id = bench_tenant()
    outcomes: dict[str, Any] = {}
    try:
        for policy, model in POLICIES:
            label = f"{policy}_{'small' if model == SMALL else 'large'}"
            outcomes[label] = _run(tenant_id, label, policy, model, steps)
    finally:
        drop_tenant(tenant_id)
        server.shutdown()
    rows = _curves(stub.sent, list(outcomes), steps)
    if csv:
        with Path(csv).open("w", newline="") as handle:
            writer = DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if plot:
        plots.plot_context(rows, Path(plot))
    emit("context", _report(stub.sent, outcomes, rows))
