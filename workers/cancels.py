"""Cancellation of steps in flight: a cancel stops a step's wait on its model or a tool.

The API flags the task (``cancel_requested_at``) and publishes its id on a Redis channel; each
worker process listens there and wakes the step of that task if it runs here. The heartbeat
learns of the flag as well, with each lease it extends, in case the wake-up was lost.

A woken step stops waiting at once and cancels the task with a write of its own (its lease is
still valid). The call it waited on is abandoned, as at its time limit: Python cannot stop a
thread, so the model's HTTP request or the tool goes on in the background until it returns or
times out, and its result is dropped. A tool that can stop early watches
``ToolContext.cancelled`` (``sleep`` does).

Calls run on two pools of threads, one for model calls and one for tool calls, so that tools
that hang cannot keep a step of any tenant from asking its model (nor the reverse). Each pool
has a thread for every step the process runs, plus room for ``RATCHET_WORKER_MAX_ABANDONED_CALLS``
abandoned calls: a call that a step stopped waiting for and that still runs holds its thread.
When that many are abandoned and still running, the process is wedged beyond its own repair;
the callback given to :func:`on_wedged` (the worker's recycling) is told, once.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Literal, TypeVar

from shared.observability import metrics
from shared.settings import get_settings
from shared.transport import get_transport
from workers import step_pool
from workers.step_pool import Threads

log = logging.getLogger("ratchet.worker")
T = TypeVar("T")
QUICK_SECONDS = 0.002  # a call that answers within this keeps its step's turn


class Interrupted(Exception):
    """The task was cancelled while the step waited; the call is abandoned."""


class Watch:
    """One running step's cancel flag, and the waits it should cut short."""

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.cancelled = threading.Event()
        self._wakes: set[threading.Event] = set()
        self._stops: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled.set()
            wakes = list(self._wakes)
            stops = list(self._stops)
        for wake in wakes:
            wake.set()
        for stop in stops:
            stop()

    @contextmanager
    def stopping(self, stop: Callable[[], None]) -> Iterator[None]:
        """Call ``stop`` on a cancel of the task while the block runs (at once if it was
        cancelled already): a streaming model call's stream is shut, not left to run on."""
        with self._lock:
            self._stops.append(stop)
            cancelled = self.cancelled.is_set()
        if cancelled:
            stop()
        try:
            yield
        finally:
            with self._lock:
                self._stops.remove(stop)

    @contextmanager
    def waking(self, wake: threading.Event) -> Iterator[None]:
        with self._lock:
            self._wakes.add(wake)
            if self.cancelled.is_set():
                wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._wakes.discard(wake)


_watches: dict[str, Watch] = {}
_lock = threading.Lock()
_current: contextvars.ContextVar[Watch | None] = contextvars.ContextVar("watch", default=None)
_listening_in: int | None = None  # the process whose listener runs (threads die in a fork)


@contextmanager
def watching(task_id: str) -> Iterator[Watch]:
    """Let a cancel of ``task_id`` reach the step running in this block."""
    _ensure_listener()
    watch = Watch(task_id)
    with _lock:
        _watches[task_id] = watch
    token = _current.set(watch)
    try:
        yield watch
    finally:
        _current.reset(token)
        with _lock:
            if _watches.get(task_id) is watch:
                del _watches[task_id]


def current() -> Watch | None:
    """The watch of the step running here (None outside a step)."""
    return _current.get()


def cancel(task_id: str) -> None:
    """A cancel of ``task_id`` was requested: wake its step, if it runs in this process."""
    with _lock:
        watch = _watches.get(task_id)
    if watch is not None:
        log.info("cancel requested: the step in flight stops waiting", extra={"task_id": task_id})
        watch.cancel()


Pool = Literal["model", "tool"]
MODEL: Pool = "model"  # the pool of model calls
TOOL: Pool = "tool"  # the pool of tool calls


def call(
    work: Callable[[], T], *, timeout: float | None = None, name: str = "call", pool: Pool = TOOL
) -> T:
    """Run ``work`` on a thread of the ``pool`` call pool and wait for it, at most ``timeout`` s.

    Raises :class:`Interrupted` as soon as the step's task is cancelled (inside a step), and
    ``TimeoutError`` past the timeout; in both cases ``work`` is abandoned and runs on, counted
    as abandoned until it returns.
    """
    watch = current()
    outcome: list[tuple[bool, object]] = []
    wake = threading.Event()
    context = contextvars.copy_context()  # its logs and spans stay the step's
    pools = _calls()
    ticket = Ticket()

    def run() -> None:
        try:
            outcome.append((True, context.run(work)))
        except BaseException as exc:  # handed over to the waiting step
            outcome.append((False, exc))
        finally:
            wake.set()
            pools.settle(ticket)

    pools.submit(pool, run)
    with watch.waking(wake) if watch is not None else nullcontext():
        # A call that answers at once (most tools do) keeps the step's turn; one that takes
        # longer gives it up to the steps waiting for one, and waits in line to take it back.
        quick = QUICK_SECONDS if timeout is None else min(QUICK_SECONDS, timeout)
        if not wake.wait(quick):
            with step_pool.waiting():
                wake.wait(None if timeout is None else timeout - quick)
    if not outcome:
        pools.abandon(ticket, pool=pool)
    if watch is not None and watch.cancelled.is_set():
        # Even if it returned meanwhile: a tool that watches the cancel returns cut short.
        raise Interrupted(f"task {watch.task_id} was cancelled")
    if outcome:
        ok, value = outcome[0]
        if ok:
            return value  # type: ignore[return-value]
        raise value  # type: ignore[misc]
    raise TimeoutError(f"{name} did not return within {timeout:g} s")


def pause(seconds: float) -> None:
    """Wait ``seconds`` as a step waits on a call: without its turn, and cut short by a cancel
    of its task (:class:`Interrupted`)."""
    watch = current()
    with step_pool.waiting():
        if watch is None:
            time.sleep(seconds)
        elif watch.cancelled.wait(seconds):
            raise Interrupted(f"task {watch.task_id} was cancelled")


@dataclass
class Ticket:
    """One call's standing: whether it returned, and whether its step stopped waiting first."""

    done: bool = False
    abandoned: bool = False


class CallPools:
    """A process's two call pools and its count of abandoned calls still running.

    Only a call whose step stopped waiting for it is counted, from then until it returns; at
    ``limit`` of them the ``wedged`` callback runs (once: the process is on its way out)."""

    def __init__(self, threads: int, *, limit: int) -> None:
        self.limit = limit
        self.abandoned = 0
        self._pools = {
            kind: Threads(threads + limit, name=f"{kind}-call") for kind in (MODEL, TOOL)
        }
        self._lock = threading.Lock()
        self._told = False

    def submit(self, pool: Pool, work: Callable[[], None]) -> None:
        self._pools[pool].submit(work)

    def abandon(self, ticket: Ticket, *, pool: Pool) -> None:
        """The step stopped waiting for this call: count it, if it still runs."""
        with self._lock:
            if ticket.done:
                return
            ticket.abandoned = True
            self.abandoned += 1
            wedged = self.abandoned >= self.limit and not self._told
            self._told = self._told or wedged
            running = self.abandoned
        metrics.abandoned_calls.labels(pool=pool).inc()
        if wedged:
            _wedged(f"{running} abandoned calls still run (RATCHET_WORKER_MAX_ABANDONED_CALLS)")

    def settle(self, ticket: Ticket) -> None:
        """The call returned: it holds its thread no longer."""
        with self._lock:
            ticket.done = True
            if ticket.abandoned:
                self.abandoned -= 1


_pools: dict[int, CallPools] = {}
_on_wedged: Callable[[str], None] | None = None


def _calls() -> CallPools:
    """This process's call pools, started on first use (threads do not survive a fork), and
    reused: starting a thread per call costs a step more than the call's own Python work. A
    worker process makes them as it starts (``warm``)."""
    pool = _pools.get(os.getpid())
    if pool is None:
        settings = get_settings()
        with _lock:
            pool = _pools.get(os.getpid()) or _pools.setdefault(
                os.getpid(),
                CallPools(settings.worker_threads, limit=settings.worker_max_abandoned_calls),
            )
    return pool


def abandoned() -> int:
    """How many calls of this process were abandoned and still run."""
    pool = _pools.get(os.getpid())
    return 0 if pool is None else pool.abandoned


def on_wedged(callback: Callable[[str], None]) -> None:
    """Call ``callback(reason)`` once, when this process's abandoned calls reach the limit
    (from the step that abandoned the last of them: it should return at once)."""
    global _on_wedged  # noqa: PLW0603 - one process, one way out
    _on_wedged = callback


def _wedged(reason: str) -> None:
    if _on_wedged is None:
        log.warning("this process is wedged: %s; restart it", reason)
        return
    _on_wedged(reason)


def warm() -> None:
    """Start this process's call threads now rather than during its first steps."""
    _calls()


def _ensure_listener() -> None:
    global _listening_in  # noqa: PLW0603 - one listener per process
    if _listening_in == os.getpid():
        return
    with _lock:
        if _listening_in == os.getpid():
            return
        _listening_in = os.getpid()
    # Redis: a thread of its own follows the cancels channel; in one process (``ratchet dev``)
    # the API's cancel calls ``cancel`` directly.
    get_transport().follow_cancels(cancel, log=log)
