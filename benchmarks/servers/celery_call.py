"""The baseline of ``ratchet bench latency``: a bare Celery task that asks the model once.

``call`` posts one chat completion to the model server and returns its answer's text, which
the client reads through Redis as Celery's result. The app is configured by
``shared.queue.configure``, as Ratchet's is (late acks, one message prefetched, JSON), with a
Redis result backend added, so the comparison shows what Ratchet adds to a message, a model
call and a result.

Its worker runs as ``python -m celery -A benchmarks.servers.celery_call worker -Q QUEUE``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import httpx
from celery import Celery

from shared.queue import configure
from shared.settings import get_settings

CALL_TASK = "benchmarks.call"


def _call_app() -> Celery:
    # Built at import, as the worker's app is: ``celery -A`` needs it there.
    settings = get_settings()
    app = Celery("ratchet-bench-call", set_as_current=False)
    configure(app, settings)
    app.conf.update(result_backend=settings.redis_url, task_ignore_result=False)
    return app


app = _call_app()


@lru_cache
def _client() -> httpx.Client:
    return httpx.Client(base_url=get_settings().openai_base_url or "", timeout=30)


@app.task(name=CALL_TASK)
def call(text: str) -> str:
    """One chat completion of ``text``; its answer's text."""
    body: dict[str, Any] = {"model": "bench", "messages": [{"role": "user", "content": text}]}
    answer = _client().post("/chat/completions", json=body).json()
    return str(answer["choices"][0]["message"]["content"])
