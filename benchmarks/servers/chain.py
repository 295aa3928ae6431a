"""The baseline of ``ratchet bench throughput``: a bare Celery chain with Ratchet's settings.

One task, ``hop``, sends the next hop until none remain, then notes when its chain ended. The
app is configured by ``shared.queue.configure``, as Ratchet's is (late acks, one message
prefetched, JSON, no results), and does nothing else, so the comparison shows what Ratchet's
steps add to the messages alone.

Its worker runs as ``python -m celery -A benchmarks.servers.chain worker -Q QUEUE`` with
``RATCHET_QUEUE_NAME=QUEUE``: the queue name says where later hops go and where ends are noted.
"""

from __future__ import annotations

import time
from functools import lru_cache

import redis
from celery import Celery

from shared.queue import configure
from shared.settings import get_settings

HOP_TASK = "benchmarks.hop"
DONE_KEY_PREFIX = "ratchet:bench:chain:"


def done_key(queue: str) -> str:
    """The Redis list of the end times (epoch seconds) of the chains sent to ``queue``."""
    return f"{DONE_KEY_PREFIX}{queue}:done"


def _chain_app() -> Celery:
    # Built at import, as the worker's app is: ``celery -A`` needs it there.
    app = Celery("ratchet-bench-chain", set_as_current=False)
    configure(app, get_settings())
    return app


app = _chain_app()


@lru_cache
def _redis() -> redis.Redis:
    return redis.Redis.from_url(get_settings().redis_url)


def send_hop(chain_id: str, remaining: int, *, queue: str) -> None:
    """Send one hop, sent the way Ratchet sends a step: by name, to a named queue."""
    app.send_task(HOP_TASK, args=[chain_id, remaining], queue=queue)


@app.task(name=HOP_TASK)
def hop(chain_id: str, remaining: int) -> None:
    """One step of a chain: the next hop's message while ``remaining`` hops follow this one,
    else the chain's end time."""
    queue = get_settings().queue_name
    if remaining > 0:
        send_hop(chain_id, remaining - 1, queue=queue)
    else:
        _redis().rpush(done_key(queue), time.time())
