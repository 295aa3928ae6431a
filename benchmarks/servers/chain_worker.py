"""The chain's side of ``ratchet bench throughput``: its worker, started and paused as
Ratchet's is, and the chains loaded into it (``benchmarks.servers.chain`` is the app the
worker runs)."""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, cast

from benchmarks.harness.processes import Child, Worker
from benchmarks.servers.chain import _redis, done_key, send_hop
from benchmarks.servers.chain import app as chain_app


@dataclass
class Chain:
    """Bare Celery chains; each notes its end time in a Redis list."""

    worker: Worker
    count: int = 0

    def load(self, steps: int, *, count: int) -> None:
        _redis().delete(done_key(self.worker.queue))
        for number in range(count):
            send_hop(str(number), steps - 1, queue=self.worker.queue)
        self.count = count

    def prepare(self) -> None:
        pass  # the messages are in the broker since load()

    def release(self) -> None:
        pass  # the paused worker holds the messages

    def done(self) -> bool:
        return cast(int, _redis().llen(done_key(self.worker.queue))) >= self.count

    def outcome(self) -> dict[str, Any]:
        ends = cast(list[bytes], _redis().lrange(done_key(self.worker.queue), 0, -1))
        return {"ended_at": max(float(end) for end in ends), "completed": len(ends)}


def start_chain(stack: ExitStack, run: str, *, processes: int) -> Chain:
    """The chain's worker, with the options Ratchet's worker runs with, paused."""
    queue, hostname = f"bench-chain-{run}", f"chain-{run}@bench"
    argv = ["celery", "-A", "benchmarks.servers.chain", "worker"]
    argv += ["--pool", "prefork", "--concurrency", str(processes), "--prefetch-multiplier", "1"]
    argv += ["-Q", queue, "--hostname", hostname, "--loglevel", "WARNING"]
    argv += ["--without-gossip", "--without-mingle"]
    env = {**os.environ, "RATCHET_QUEUE_NAME": queue}
    child = stack.enter_context(Child(*argv, env=env, keep_stdout=True))
    worker = Worker(chain_app, hostname, queue, child)
    worker.wait_ready()
    return Chain(worker)
