"""``ratchet bench throughput``: tasks per second through Ratchet, against a bare Celery chain.

Both run in one invocation on the same Redis broker with the same number of worker processes,
and take turns (Ratchet 1-step, chain 1-step, Ratchet 3-step, chain 3-step) so drift on a
noisy machine hits both alike.

Ratchet: ``ratchet api`` and ``ratchet worker`` (scripted model, answering at once; the
3-step task makes two calculator calls). The chain: one Celery task sending the next hop
until the chain's last, with Ratchet's Celery settings, on the same broker with as many
processes. Before each measured run the worker is paused (remote control) and all its
tasks are loaded: Ratchet's through the HTTP API, the chains' first hops straight to the
broker (and Ratchet's made due, as submitted). The span runs from waking Ratchet's
dispatcher and resuming the worker to the last task's recorded end, so it is admission
and execution for Ratchet, execution for the chain (which has no admission): HTTP
submission is reported apart (``submit_per_s``),
since a client submitting while the workers run would share their cores. CPU per step
is counted over the span: the worker's process tree, and the machine as a whole
(Postgres, Redis and any other load included; ``background_cores`` is that other load,
sampled while everything here sits idle).

After a warm-up, each shape runs ``--rounds`` times on both, taking turns; the median run
of each is reported, and the ratio is of the medians.

With ``--live``, Ratchet's tasks are submitted over HTTP while its worker runs, and its
span runs from the first submission: the whole way, the API sharing the cores (the
chain's is as before, execution alone). With ``--langgraph``, each round also runs the
same tasks as a LangGraph graph checkpointed by ``PostgresSaver`` on the same database
(a superstep's checkpoint written before the next), on a pool of as many threads as the
worker has processes (``benchmarks.servers.langgraph_peer``).
"""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import typer

from benchmarks.harness.common import bench_key, drop_tenant, emit, libpq_url
from benchmarks.harness.processes import (
    Child,
    Worker,
    background_cores,
    free_port,
    machine_busy_seconds,
    wait_ok,
    wait_until,
)

if TYPE_CHECKING:
    from benchmarks.servers.chain_worker import Chain

SHAPES = (1, 3)  # steps per task (hops per chain)
WARM_UP = 20  # tasks per system and shape first, unmeasured: imports, pools, caches
SUBMITTERS = 4  # threads posting tasks to the API
TARGET_RATIO = 0.5
_CALL: dict[str, Any] = {"tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]}
SCRIPTS: dict[int, list[dict[str, Any]]] = {
    1: [{"content": "done"}],
    3: [_CALL, _CALL, {"content": "done"}],
}


class System(Protocol):
    """What a measurement needs of Ratchet or of the chain."""

    worker: Worker

    def load(self, steps: int, *, count: int) -> None: ...

    def prepare(self) -> None:
        """Before the span: what a real submission would have done to the loaded work."""
        ...

    def release(self) -> None:
        """Let the loaded work run (the worker is resumed next)."""
        ...

    def done(self) -> bool: ...

    def outcome(self) -> dict[str, Any]:
        """Figures of the run just done, with ``ended_at``: when its last task finished."""
        ...


# --- Ratchet -----------------------------------------------------------------------------


def _post_many(count: int, *, url: str, key: str, body: dict[str, Any]) -> list[str]:
    """Post ``count`` tasks one after another on one keep-alive client; their ids."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        ids = []
        for _ in range(count):
            response = client.post("/v1/tasks", json=body)
            response.raise_for_status()
            ids.append(response.json()["id"])
    return ids


def _body(steps: int, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input": "benchmark",
        "model": "scripted",
        "model_options": {"script": SCRIPTS[steps]},
        **extra,
    }
    if steps > 1:
        body["tools"] = ["calculator"]
    return body


@dataclass
class Ratchet:
    """Ratchet's API and one worker; tasks go in over HTTP, completion is read from Postgres.

    Loaded (the default), the tasks are submitted first, not due for an hour, and made due
    at release: the span is their admission and execution. Live (``--live``), nothing is
    loaded and release submits them while the worker runs: the span is the whole way, from
    the first submission to the last task's end, the API sharing the cores."""

    worker: Worker
    url: str
    key: str
    live: bool = False
    ids: list[str] = field(default_factory=list)
    submit_per_s: float = 0.0
    _steps: int = 1
    _count: int = 0
    _submitting: Future[None] | None = None
    _pending: set[str] | None = None

    def load(self, steps: int, *, count: int) -> None:
        self._steps, self._count, self.ids, self._pending = steps, count, [], None
        if not self.live:
            # Not due for an hour: the dispatcher keeps them in the backlog until prepare().
            self._submit(_body(steps, delay_seconds=3600))

    def _submit(self, body: dict[str, Any]) -> None:
        each, extra = divmod(self._count, SUBMITTERS)
        shares = [each + (i < extra) for i in range(SUBMITTERS)]
        started = time.perf_counter()
        with ThreadPoolExecutor(SUBMITTERS) as pool:
            batches = pool.map(partial(_post_many, url=self.url, key=self.key, body=body), shares)
            self.ids = [task_id for batch in batches for task_id in batch]
        self.submit_per_s = self._count / (time.perf_counter() - started)

    def prepare(self) -> None:
        """Loaded: make the backlog due now, as a submission would have made each task (the
        paused worker would not hold the backlog: admission does not go through its
        consumer). Not timed: the chain's messages are likewise in the broker before its
        span. Admission waits for the wake-up that ``release`` sends."""
        if self.live:
            return
        from sqlalchemy import update

        from shared.store.db import now_ms, transaction
        from shared.store.tables import Task

        with transaction() as session:
            session.execute(update(Task).where(Task.id.in_(self.ids)).values(due_ms=now_ms()))

    def release(self) -> None:
        """Loaded: wake the dispatcher to the due backlog (what follows is admission and
        execution, as after any submission). Live: start submitting."""
        if self.live:
            self._submitting = ThreadPoolExecutor(1).submit(self._submit, _body(self._steps))
            return
        import redis

        from shared.scheduling.wake import channel
        from shared.settings import get_settings

        # The worker's dispatcher listens on its own queue's channel, not on this process's
        # (a wake-up there was lost: the dispatcher found the backlog on its next idle look,
        # up to a quarter of a second into the measured span).
        client = redis.Redis.from_url(get_settings().redis_url)
        client.publish(channel(self.worker.queue), "1")
        client.close()

    def done(self) -> bool:
        """Whether every task ended. Each look reads only the tasks not yet seen ending (by
        key), so the looks cost the database about one read per task in all: a count over
        every task each time competed with the run it measures."""
        from sqlalchemy import String, any_, cast, select
        from sqlalchemy.dialects.postgresql import ARRAY

        from shared.statuses import TERMINAL_STATUSES, in_order
        from shared.store.db import transaction
        from shared.store.tables import Task

        if self._submitting is not None:
            if not self._submitting.done():
                return False
            self._submitting.result()  # a failed submission fails the run
        if self._pending is None:
            self._pending = set(self.ids)
        if not self._pending:
            return True
        ended = select(Task.id).where(
            Task.id == any_(cast(list(self._pending), ARRAY(String))),
            Task.status.in_(in_order(TERMINAL_STATUSES)),
        )
        with transaction() as session:
            self._pending.difference_update(session.scalars(ended))
        return not self._pending

    def outcome(self) -> dict[str, Any]:
        """Fails when a task did not succeed: a rate of failures would mean nothing."""
        from sqlalchemy import select

        from shared.statuses import TaskStatus
        from shared.store.db import transaction
        from shared.store.tables import Task

        query = select(Task.status, Task.steps, Task.finished_at).where(Task.id.in_(self.ids))
        with transaction() as session:
            rows = session.execute(query).all()
        statuses = Counter(row.status for row in rows)
        if statuses[TaskStatus.SUCCEEDED] != len(self.ids):
            raise RuntimeError(f"not every task succeeded: {dict(statuses)}")
        return {
            "ended_at": max(row.finished_at for row in rows).timestamp(),
            "steps_per_task": sum(row.steps for row in rows) / len(rows),
            "submit_per_s": self.submit_per_s,
        }


def start_ratchet(
    stack: ExitStack, run: str, *, key: str, processes: int, live: bool = False
) -> Ratchet:
    """``ratchet api`` and ``ratchet worker`` on a queue of this run's own, the worker paused."""
    from shared.queue import get_celery, webhook_queue_of

    env = {**os.environ, "RATCHET_QUEUE_NAME": f"bench-{run}"}
    port = free_port()
    api = stack.enter_context(
        Child("ratchet", "api", "--port", str(port), env=env, keep_stdout=True)
    )
    hostname = f"ratchet-{run}@bench"
    options = ["--concurrency", str(processes), "--loglevel", "WARNING", "--hostname", hostname]
    child = stack.enter_context(Child("ratchet", "worker", *options, env=env, keep_stdout=True))
    url = f"http://127.0.0.1:{port}"
    wait_ok(f"{url}/readyz", api)
    queue = env["RATCHET_QUEUE_NAME"]
    worker = Worker(get_celery(), hostname, queue, child, others=(webhook_queue_of(queue),))
    worker.wait_ready()
    return Ratchet(worker, url, key, live=live)


# --- measuring ---------------------------------------------------------------------------


def measure(system: System, steps: int, *, count: int, timeout: float) -> dict[str, Any]:
    """Load ``count`` tasks of ``steps`` steps while the worker is paused, then time it from
    their release (and the worker's resuming) to the last task's end; CPU over the same span."""
    system.worker.pause()
    system.load(steps, count=count)
    system.prepare()
    cpu, machine = system.worker.cpu_seconds(), machine_busy_seconds()
    started = time.time()
    system.release()
    system.worker.resume()
    what = f"{count} tasks of {steps} steps did not finish"
    wait_until(system.done, what=what, child=system.worker.child, seconds=timeout)
    cpu, machine = system.worker.cpu_seconds() - cpu, machine_busy_seconds() - machine
    figures = system.outcome()
    seconds = figures.pop("ended_at") - started
    return {
        "tasks_per_s": count / seconds,
        "seconds": seconds,
        "worker_cpu_ms_per_step": 1000 * cpu / (count * steps),
        "machine_cpu_ms_per_step": 1000 * machine / (count * steps),
        # well under the core count: the run waited on something other than CPU
        "machine_busy_cores": machine / seconds,
        **figures,
    }


def compare(
    ratchet: Ratchet,
    chain: Chain,
    *,
    tasks: int,
    rounds: int,
    timeout: float,
    langgraph: bool = False,
    threads: int = 2,
) -> dict[str, Any]:
    """Every shape on both systems after a warm-up, taking turns, ``rounds`` times (and on
    the LangGraph peer, which warms up in its own process, if asked)."""
    from benchmarks.servers import langgraph_peer

    systems = (("ratchet", ratchet), ("chain", chain))
    for _, system in systems:
        for steps in SHAPES:
            measure(system, steps, count=WARM_UP, timeout=timeout)
    report: dict[str, Any] = {"background_cores_before": background_cores()}
    runs: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for _ in range(rounds):
        for steps in SHAPES:
            for name, system in systems:
                runs[name, steps].append(measure(system, steps, count=tasks, timeout=timeout))
            if langgraph:
                peer = langgraph_peer.measure(steps, count=tasks, threads=threads, url=libpq_url())
                runs["langgraph", steps].append(peer)
    for steps in SHAPES:
        report[f"{steps}_step"] = shape = verdict(runs["ratchet", steps], runs["chain", steps])
        if langgraph:
            shape["langgraph"] = peer = _median(runs["langgraph", steps])
            shape["ratio_to_langgraph"] = shape["ratchet"]["tasks_per_s"] / peer["tasks_per_s"]
    report["background_cores_after"] = background_cores()
    return report


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median rate (whole, so its figures agree), and every run's rate."""
    middle = sorted(runs, key=lambda run: run["tasks_per_s"])[len(runs) // 2]
    return {**middle, "rounds_tasks_per_s": [run["tasks_per_s"] for run in runs]}


def verdict(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratchet's median run against the chain's, and whether it meets the target."""
    mine, baseline = _median(ours), _median(theirs)
    ratio = mine["tasks_per_s"] / baseline["tasks_per_s"]
    return {
        "ratchet": mine,
        "chain": baseline,
        "ratio": ratio,
        "meets_target": ratio >= TARGET_RATIO,
    }


def _forget(run: str) -> None:
    """Delete the Redis keys this run made: its queues, their bindings, the chain's ends."""
    from benchmarks.servers.chain import _redis, done_key

    client = _redis()
    for queue in (f"bench-{run}", f"bench-{run}.webhooks", f"bench-chain-{run}"):
        client.delete(
            queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}", done_key(queue)
        )


def throughput(
    *,
    tasks: int = typer.Option(300, help="tasks (and chains) per shape"),
    processes: int = typer.Option(2, help="worker processes, the same for both"),
    rounds: int = typer.Option(3, help="measured runs of each; the median run is reported"),
    timeout: float = typer.Option(120.0, help="seconds one measured run may take"),
    live: bool = typer.Option(
        False, help="submit Ratchet's tasks while its worker runs, timed from the first"
    ),
    langgraph: bool = typer.Option(
        False, help="also run the same loop on LangGraph with PostgresSaver, as many threads"
    ),
) -> None:
    """Tasks/s of 1-step and 3-step tasks through Ratchet (loaded first, or --live) against
    a bare Celery chain on the same broker and processes, and with --langgraph against
    LangGraph + PostgresSaver; the median of --rounds turns of each."""
    from shared.store import backends

    if backends.current().name != "postgresql":
        raise typer.BadParameter("set RATCHET_DATABASE_URL to a PostgreSQL database")
    tenant_id, key = bench_key()  # once the database is known to be migrated
    run = uuid.uuid4().hex[:8]
    try:
        with ExitStack() as stack:
            ratchet = start_ratchet(stack, run, key=key, processes=processes, live=live)
            from benchmarks.servers.chain_worker import start_chain

            chain = start_chain(stack, run, processes=processes)
            report = compare(
                ratchet,
                chain,
                tasks=tasks,
                rounds=rounds,
                timeout=timeout,
                langgraph=langgraph,
                threads=processes,
            )
    finally:
        drop_tenant(tenant_id)
        _forget(run)
        if langgraph:
            from benchmarks.servers import langgraph_peer

            langgraph_peer.drop(libpq_url())
    target = f">= {TARGET_RATIO}x the raw Celery chain"
    emit(
        "throughput",
        {"processes": processes, "tasks": tasks, "live": live, **report, "target": target},
    )
