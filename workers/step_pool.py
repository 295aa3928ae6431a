"""The step pool: the threads on which a worker process runs its steps.

A Celery message hands its step to this pool and is done with it; the step runs on one of the
pool's threads. Most of a step is waiting (on the model, on a tool), and a waiting step holds
its thread and nothing scarcer: no database connection (each write takes one from the pool
for its statement), no Celery slot, no process. So a process keeps ``RATCHET_WORKER_THREADS``
steps in flight while its prefork slot goes on taking messages. When every thread is busy
the hand-off waits for one to free up: the process never takes more than it can run, and the
broker keeps the rest for other workers.

The threads start with the process, alongside its first messages: a hand-off only puts the
step on a queue. (A pool that started a thread per hand-off, as ``ThreadPoolExecutor`` does until
it is full, made the message's thread wait for the new one to be scheduled, and in a process
busy with hundreds of steps that wait held up every message behind it.)

A message is acknowledged once its step is handed over. If the process dies after that, the
step's lease runs out (or, before the lease, the task's due time passes) and the sweeper sends
the task a new message: nothing is lost, nothing is done twice (DESIGN.md §5).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from functools import partial

from shared.settings import get_settings

log = logging.getLogger("ratchet.worker")


class Threads:
    """A fixed set of daemon threads taking work from one queue in turn. Work handed over
    while every thread is busy waits in the queue. (A process that exits ends them: the step
    pool's drain lets its steps commit first.)

    A thread of their own starts them, one after the other (hundreds take a good part of a
    second): the process goes on meanwhile, and work handed over early waits in the queue
    for the first of them. ``started`` is set once all run."""

    def __init__(self, threads: int, *, name: str) -> None:
        self._work: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.started = threading.Event()
        threading.Thread(
            target=self._start, args=(threads, name), name=f"{name}-starter", daemon=True
        ).start()

    def _start(self, threads: int, name: str) -> None:
        for number in range(threads):
            threading.Thread(target=self._serve, name=f"{name}-{number}", daemon=True).start()
        self.started.set()

    def submit(self, work: Callable[[], None]) -> None:
        """Queue ``work`` for the next free thread; never waits."""
        self._work.put(work)

    def _serve(self) -> None:
        while True:
            self._work.get()()


class StepPool:
    """A fixed set of threads, started with it; :meth:`run` waits for a free one, then hands
    the work over."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._free = threading.BoundedSemaphore(threads)
        self._busy = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._threads = Threads(threads, name="step")

    def run(self, work: Callable[[], None], *, wait: bool = True) -> bool:
        """Start ``work`` on a free thread (waiting for one, unless not ``wait``); return
        without waiting for it. Whether it started (always, when waiting)."""
        if not self._free.acquire(blocking=wait):
            return False
        with self._lock:
            self._busy += 1
        self._threads.submit(partial(self._guarded, work))
        return True

    @property
    def busy(self) -> int:
        """How many steps are running now."""
        return self._busy

    def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for the running steps to end; returns how many still run."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._busy and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
            return self._busy

    def _guarded(self, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception:
            # The step's lease runs out and the sweeper sends it again: log it and go on.
            log.exception("step failed; its lease will run out and it will be retried")
        finally:
            self._done()

    def _done(self) -> None:
        with self._lock:
            self._busy -= 1
            self._idle.notify_all()
        self._free.release()


_pools: dict[int, StepPool] = {}
_pools_lock = threading.Lock()
_stopping = threading.Event()


def accepting() -> bool:
    """Whether a step that has just committed may go on with the task's next one here: not
    once this process is stopping (the next step goes back on the queue then)."""
    return not _stopping.is_set()


def get_pool() -> StepPool:
    """This process's pool, made on first use (after any fork: threads do not survive one)."""
    pid = os.getpid()
    pool = _pools.get(pid)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(pid) or _pools.setdefault(
                pid, StepPool(get_settings().worker_threads)
            )
    return pool


def drain(timeout: float) -> None:
    """At shutdown: let the steps in flight finish and commit, for up to ``timeout`` s. Any
    still running then end with the process; their leases run out and they run again."""
    _stopping.set()
    pool = _pools.get(os.getpid())
    if pool is None or not pool.busy:
        return
    log.info("waiting up to %.0f s for %d step(s) in flight", timeout, pool.busy)
    left = pool.drain(timeout)
    if left:
        log.warning("%d step(s) still running at shutdown; they will run again", left)
