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

Of those threads, only a few run at once: a step takes one of the process's *turns* to run
its own Python and statements, and gives it up while it waits on its model or a tool
(``cancels.call``). There are as many turns as database connections in the pool, so a step
that runs never waits for a connection, and the threads that wait are blocked, not runnable:
they do not compete for the interpreter with the steps that are working. (Without turns,
hundreds of steps woken by their answers at once took the pool's few connections in no
particular order; each holder then waited for the interpreter between its round trips, and
a step could wait seconds for its first statement.) Turns are handed out first come, first
served.

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
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


class Turns:
    """First come, first served: at most ``count`` holders at a time, the others waiting in
    the order they came (``threading.Semaphore`` lets a newcomer take a turn just given up
    ahead of those that waited)."""

    def __init__(self, count: int) -> None:
        self._free = count
        self._waiting: deque[threading.Lock] = deque()
        self._lock = threading.Lock()

    def take(self) -> None:
        with self._lock:
            if self._free and not self._waiting:
                self._free -= 1
                return
            ticket = threading.Lock()
            ticket.acquire()
            self._waiting.append(ticket)
        ticket.acquire()  # released by give() with the turn handed over

    def give(self) -> None:
        with self._lock:
            if self._waiting:
                self._waiting.popleft().release()
            else:
                self._free += 1


_holding = threading.local()


@contextmanager
def waiting() -> Iterator[None]:
    """Give up this thread's turn, if it holds one, for the block: a step waiting on its
    model or a tool. Taken back (in turn) when the wait is over."""
    turns: Turns | None = getattr(_holding, "turns", None)
    if turns is None:
        yield
        return
    turns.give()
    _holding.turns = None
    try:
        yield
    finally:
        turns.take()
        _holding.turns = turns


def held() -> Turns | None:
    """The turns this thread takes one of, if it runs a step: its helpers take theirs from
    the same (:func:`turn_of`)."""
    return getattr(_holding, "turns", None)


@contextmanager
def turn_of(turns: Turns | None) -> Iterator[None]:
    """Run the block in a turn of ``turns``, as a step's own thread runs, giving it up while
    it waits on a call (:func:`waiting`): a thread that runs part of a step for it (one of
    its tool calls). Without turns (a step run outside the pool), the block just runs."""
    if turns is None:
        yield
        return
    turns.take()
    _holding.turns = turns
    try:
        yield
    finally:
        _holding.turns = None
        turns.give()


class StepPool:
    """A fixed set of threads, started with it; :meth:`run` waits for a free one, then hands
    the work over. The work runs in turns (:class:`Turns`): ``turns`` at a time."""

    def __init__(self, threads: int, turns: int | None = None) -> None:
        self.threads = threads
        self.turns = Turns(turns or threads)
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
        self.turns.take()
        _holding.turns = self.turns
        try:
            work()
        except Exception:
            # The step's lease runs out and the sweeper sends it again: log it and go on.
            log.exception("step failed; its lease will run out and it will be retried")
        finally:
            _holding.turns = None
            self.turns.give()
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
        settings = get_settings()
        with _pools_lock:
            pool = _pools.get(pid) or _pools.setdefault(
                pid, StepPool(settings.worker_threads, turns=settings.db_pool_size)
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
