"""``ratchet bench limiter``: rate-limiter decisions per second and their latency.

At 1, 16 and 64 concurrent clients across processes, against a bare Redis INCR with the same
client; and the admitted count of a saturated bucket against its configured rate.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import typer

from benchmarks.harness.common import emit, summary

KINDS = ("incr", "limiter", "limiter3")
SLICE_SECONDS = 0.25  # the kinds take turns in slices this long, so drift hits them alike
START_SECONDS = 3.0  # time for every process to start before they all begin together
SATURATED_BUCKET = "bench:saturated"
SATURATED_CAPACITY = 10  # the saturated bucket's burst
SATURATING_THREADS = 8  # per process


def _client_loop(
    redis_url: str, *, threads: int, seconds: float, start_at: float, results: Any
) -> None:
    """One process's clients: every kind in turn, each client timing every operation."""
    import redis

    from shared.ratelimit.buckets import Bucket, Take
    from shared.ratelimit.limiter import RedisLimiter

    client = redis.Redis.from_url(redis_url)
    limiter = RedisLimiter(client)
    scope = "bench"
    # "limiter": one requests bucket and the model's 429 block (the common case);
    # "limiter3": a model's requests and tokens buckets and a tenant bucket, and the block.
    one = [Take(Bucket(f"model:{scope}:requests", rate=1e12))]
    three = [
        *one,
        Take(Bucket(f"model:{scope}:tokens", rate=1e15), 500),
        Take(Bucket(f"tenant:{scope}:requests", rate=1e12)),
    ]
    key = "ratchet:bench:incr"
    ops: dict[str, Callable[[], object]] = {
        "incr": lambda: client.incr(key),
        "limiter": lambda: limiter.acquire(one, blocks=[scope]),
        "limiter3": lambda: limiter.acquire(three, blocks=[scope]),
    }
    latencies: list[dict[str, list[float]]] = [defaultdict(list) for _ in range(threads)]

    def run(index: int) -> None:
        while time.time() < start_at:
            time.sleep(0.001)
        deadline, mine = start_at + seconds, latencies[index]
        while (now := time.time()) < deadline:
            turn = int((now - start_at) / SLICE_SECONDS)
            kind, turn_ends = KINDS[turn % len(KINDS)], start_at + (turn + 1) * SLICE_SECONDS
            op, out = ops[kind], mine[kind]
            while time.time() < turn_ends:
                started = time.perf_counter()
                op()
                out.append((time.perf_counter() - started) * 1000)

    _run_threads(run, count=threads)
    results.put({kind: [x for lane in latencies for x in lane[kind]] for kind in KINDS})


def _run_threads(run: Callable[[int], None], *, count: int) -> None:
    """``run(0)`` to ``run(count - 1)`` at once, each on a thread, until all return."""
    pool = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()


def _in_processes(
    target: Callable[..., None], *, processes: int, timeout: float, **kwargs: Any
) -> list[Any]:
    """Run ``target`` in ``processes`` fresh processes that begin together; what each put
    on its results queue, in the order they finished."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    start_at = time.time() + START_SECONDS
    procs = [
        context.Process(target=target, kwargs={**kwargs, "start_at": start_at, "results": results})
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    collected = [results.get(timeout=timeout) for _ in procs]
    for proc in procs:
        proc.join()
    return collected


def _measure(redis_url: str, *, clients: int, seconds: float) -> dict[str, dict[str, float]]:
    """Every kind at ``clients`` concurrent clients, taking turns in short slices."""
    processes = 1 if clients == 1 else 2
    merged: dict[str, list[float]] = defaultdict(list)
    for result in _in_processes(
        _client_loop,
        processes=processes,
        timeout=seconds + 60,
        redis_url=redis_url,
        threads=clients // processes,
        seconds=seconds,
    ):
        for kind, values in result.items():
            merged[kind] += values
    each = seconds / len(KINDS)  # the time each kind had
    return {
        kind: {"ops_per_s": len(merged[kind]) / each, **summary(merged[kind])} for kind in KINDS
    }


def _saturate(
    redis_url: str, *, rate_per_s: float, seconds: float, start_at: float, results: Any
) -> None:
    """One process's clients taking from the saturated bucket as fast as it lets them."""
    import redis

    from shared.ratelimit.buckets import Bucket, Take
    from shared.ratelimit.limiter import RedisLimiter

    limiter = RedisLimiter(redis.Redis.from_url(redis_url))
    bucket = Bucket(
        SATURATED_BUCKET, rate=rate_per_s * 60, period_s=60, capacity=SATURATED_CAPACITY
    )
    admitted = [0] * SATURATING_THREADS

    def run(index: int) -> None:
        while time.time() < start_at:
            time.sleep(0.001)
        while time.time() < start_at + seconds:
            decision = limiter.acquire([Take(bucket)])
            if decision.allowed:
                admitted[index] += 1
            else:
                time.sleep(min(decision.retry_after_ms, 2) / 1000)

    _run_threads(run, count=SATURATING_THREADS)
    results.put(sum(admitted))


def _saturated(redis_url: str, *, rate: float, seconds: float) -> dict[str, Any]:
    """Two processes on one bucket: what it admitted against its burst and refill."""
    admitted = sum(
        _in_processes(
            _saturate,
            processes=2,
            timeout=seconds + 60,
            redis_url=redis_url,
            rate_per_s=rate,
            seconds=seconds,
        )
    )
    expected = SATURATED_CAPACITY + rate * seconds  # burst + refill over the run
    return {
        "configured_per_s": rate,
        "seconds": seconds,
        "admitted": admitted,
        "expected": expected,
        "error_pct": 100 * (admitted - expected) / expected,
    }


def limiter(
    *,
    seconds: float = typer.Option(15.0, help="seconds per concurrency level (all kinds)"),
    saturate_seconds: float = typer.Option(60.0, help="length of the saturated accuracy run"),
    rate: float = typer.Option(100.0, help="the saturated bucket's rate, per second"),
) -> None:
    """Limiter decisions/s and latency vs a bare Redis INCR; admitted vs configured rate."""
    import redis

    from shared.ratelimit.buckets import Bucket
    from shared.settings import get_settings

    url = get_settings().redis_url
    redis.Redis.from_url(url).delete(Bucket(SATURATED_BUCKET, rate=1).key)
    levels: dict[str, Any] = {}
    for clients in (1, 16, 64):
        measured = _measure(url, clients=clients, seconds=seconds)
        incr, decision, decision3 = (measured[kind] for kind in KINDS)
        levels[str(clients)] = {
            "incr": incr,
            "limiter": decision,
            "rate_ratio": decision["ops_per_s"] / incr["ops_per_s"],
            "limiter_three_buckets": decision3,
            "rate_ratio_three_buckets": decision3["ops_per_s"] / incr["ops_per_s"],
        }
    saturated = _saturated(url, rate=rate, seconds=saturate_seconds)
    emit("limiter", {"concurrency": levels, "saturated": saturated})
