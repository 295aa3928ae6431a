"""``ratchet bench latency``: what a task's fixed costs add to a waiting client, on an idle fleet.

A chat is waited on, so two spans matter more than throughput:

- **to the model**: from the moment the client has its ``202`` to the moment the model server
  receives the task's first request (admission, the message, the lease, the prompt);
- **to the client**: from the moment the model server has sent its answer to the moment a
  client long-polling ``GET /v1/tasks/{id}?wait=`` has the task's result (the commit, the
  wake-up, the read).

One task at a time, each a one-step task of an OpenAI-compatible model that answers at once
(a server in this process notes when each request arrived and when its answer went out),
against the same run's bare Celery task that makes the same call and returns the answer
through Redis (``benchmarks.servers.celery_call``). With ``--turns`` each is a turn of one
thread (``POST /v1/threads/{id}/runs``), whose model reads the turns before it. Targets
(issue 34): to the model ≤ 10 ms and to the client ≤ 15 ms, p50.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import typer

from benchmarks.harness.common import bench_key, drop_tenant, emit, host, summary
from benchmarks.harness.processes import Child, free_port, wait_ok

WORKER_CONNECT_SECONDS = 3.0
PAUSE_SECONDS = 0.05  # between samples: an idle fleet, not a queue
TARGETS = {"to_model_p50_ms": 10.0, "to_client_p50_ms": 15.0}


class ModelServer:
    """An OpenAI-compatible chat-completions server that answers "done" at once, streamed or
    not as asked, and notes by the conversation's last user message when each request
    arrived and when its answer went out (``time.time()``)."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}
        self.answered: dict[str, float] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                arrived = time.time()
                users = [m for m in body.get("messages", []) if m.get("role") == "user"]
                text = str(users[-1].get("content")) if users else ""
                server.arrived.setdefault(text, arrived)
                payload, kind = _answer(stream=bool(body.get("stream")))
                self.send_response(200)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                server.answered.setdefault(text, time.time())
                self.wfile.write(payload)

            def log_message(self, *_: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._http.server_address[1]}/v1"
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._http.shutdown()


def _answer(*, stream: bool) -> tuple[bytes, str]:
    usage = {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}
    message = {"role": "assistant", "content": "done"}
    if not stream:
        body = {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "model": "bench",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": usage,
        }
        return json.dumps(body).encode(), "application/json"
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "model": "bench"}
    chunks = [
        base | {"choices": [{"index": 0, "delta": message, "finish_reason": None}]},
        base | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        base | {"choices": [], "usage": usage},
    ]
    lines = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
    return lines.encode(), "text/event-stream"


@contextmanager
def _ratchet(env: dict[str, str], *, concurrency: int) -> Iterator[str]:
    port = free_port()
    worker = ("worker", "--concurrency", str(concurrency), "--loglevel", "WARNING")
    with (
        Child("ratchet", "api", "--port", str(port), env=env) as api,
        Child("ratchet", *worker, env=env),
    ):
        url = f"http://127.0.0.1:{port}"
        wait_ok(f"{url}/readyz", api)
        time.sleep(WORKER_CONNECT_SECONDS)
        yield url


def _ratchet_samples(
    url: str, key: str, model: ModelServer, *, samples: int, turns: bool
) -> dict[str, Any]:
    to_model: list[float] = []
    to_client: list[float] = []
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        path = "/v1/tasks"
        if turns:  # each sample a turn of one thread, which reads the turns before it
            thread = http.post("/v1/threads", json={"metadata": {"bench": "latency"}})
            path = f"/v1/threads/{thread.json()['id']}/runs"
        for number in range(-3, samples):  # three to warm up, not counted
            text = f"latency-{uuid.uuid4().hex}"
            body = {"input": text, "model": "openai:bench", "tools": [], "max_steps": 2}
            answer = http.post(path, json=body)
            accepted = time.time()
            answer.raise_for_status()
            task = http.get(f"/v1/tasks/{answer.json()['id']}", params={"wait": 30}).json()
            finished = time.time()
            if task["status"] != "succeeded":
                raise RuntimeError(f"a benchmark task ended {task['status']}: {task['error']}")
            if number >= 0:
                to_model.append((model.arrived[text] - accepted) * 1000)
                to_client.append((finished - model.answered[text]) * 1000)
            time.sleep(PAUSE_SECONDS)
    return {"to_model_ms": summary(to_model), "to_client_ms": summary(to_client)}


def _celery_samples(env: dict[str, str], model: ModelServer, *, samples: int) -> dict[str, Any]:
    queue = env["RATCHET_QUEUE_NAME"] + "-celery"
    argv = ["celery", "-A", "benchmarks.servers.celery_call", "worker", "-Q", queue]
    argv += ["--pool", "prefork", "--concurrency", "2", "--prefetch-multiplier", "1"]
    argv += ["--loglevel", "WARNING", "--without-gossip", "--without-mingle"]
    to_model: list[float] = []
    to_client: list[float] = []
    with Child(*argv, env=env | {"RATCHET_QUEUE_NAME": queue}):
        from benchmarks.servers.celery_call import call

        call.apply_async(args=("warm-up",), queue=queue).get(timeout=60)
        for number in range(-3, samples):
            text = f"latency-{uuid.uuid4().hex}"
            result = call.apply_async(args=(text,), queue=queue)
            sent = time.time()
            result.get(timeout=30)
            finished = time.time()
            if number >= 0:
                to_model.append((model.arrived[text] - sent) * 1000)
                to_client.append((finished - model.answered[text]) * 1000)
            time.sleep(PAUSE_SECONDS)
    return {"to_model_ms": summary(to_model), "to_client_ms": summary(to_client)}


def latency(
    *,
    samples: int = typer.Option(100, help="tasks, one at a time, for each side"),
    concurrency: int = typer.Option(2, help="worker processes (the default worker's)"),
    baseline: bool = typer.Option(True, help="also time the bare Celery task"),
    turns: bool = typer.Option(False, help="each task a turn of one thread"),
) -> None:
    """POST answered → first model request, and model answer → long-polling client's result."""
    tenant_id, key = bench_key()
    model = ModelServer()
    env = dict(os.environ)
    env["RATCHET_OPENAI_BASE_URL"] = model.base_url
    env["RATCHET_OPENAI_API_KEY"] = "bench"
    env["RATCHET_QUEUE_NAME"] = f"bench-{uuid.uuid4().hex[:8]}"
    os.environ.update({k: env[k] for k in ("RATCHET_OPENAI_BASE_URL", "RATCHET_QUEUE_NAME")})
    results: dict[str, Any] = {"host": host(), "samples": samples, "targets": TARGETS}
    try:
        with ExitStack() as stack:
            url = stack.enter_context(_ratchet(env, concurrency=concurrency))
            results["ratchet"] = _ratchet_samples(url, key, model, samples=samples, turns=turns)
            results["what"] = "turns of one thread" if turns else "tasks"
        if baseline:
            results["celery"] = _celery_samples(env, model, samples=samples)
            for span in ("to_model_ms", "to_client_ms"):
                ours, theirs = results["ratchet"][span]["p50"], results["celery"][span]["p50"]
                results[f"{span.removesuffix('_ms')}_p50_vs_celery"] = round(ours / theirs, 2)
    finally:
        model.close()
        drop_tenant(tenant_id)
    ratchet = results["ratchet"]
    results["met"] = {
        "to_model": ratchet["to_model_ms"]["p50"] <= TARGETS["to_model_p50_ms"],
        "to_client": ratchet["to_client_ms"]["p50"] <= TARGETS["to_client_p50_ms"],
    }
    emit("latency", results)
