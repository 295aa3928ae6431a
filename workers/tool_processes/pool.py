"""A worker process's tool processes, and one isolated call through them.

Each worker process keeps up to ``RATCHET_TOOL_PROCESS_POOL_SIZE`` tool processes, started
on first use and reused: one call at a time each. A call takes a free one (waiting, without
its step's turn, while all are busy), sends the tool's name, arguments and context, and waits
on the step's own thread for the outcome. The call's limits are kept by killing, never by
abandoning:

- past the tool's time limit, or on a cancel of its task (``cancels.Watch.stopping``), the
  tool process is killed with its whole process group (the subprocesses of the tool), so
  nothing the call would have done after that point ever happens;
- while the call runs its process tree is counted (after 10 ms, then more and more rarely,
  up to every 100 ms); past ``RATCHET_TOOL_PROCESS_MAX_PROCESSES`` descendants the group is
  killed: a fork bomb is cut off at a few dozen processes, not at the host's limit;
- a process that dies under a call (a segfault, ``os._exit``, the kernel's OOM killer, its
  CPU limit) fails that call.

A call stopped so has an unknown outcome (it may have acted before it was stopped), and the
ledger's rules for those apply; its process is gone and another is started when one is
needed. A process is also replaced, between calls, after ``RATCHET_TOOL_PROCESS_MAX_CALLS``
calls, once it holds more than ``RATCHET_TOOL_PROCESS_RECYCLE_RSS_MB`` of memory, after a
``MemoryError``, and when a call left processes behind: the processes a call starts do not
outlive it. (A process that leaves its group on purpose, ``setsid``, escapes this: code that
may be hostile belongs in the sandboxed code tool, not in a tool process.)

Nothing here holds a thread of the call pools (``cancels``): the step's thread sends, waits
and reads, so a killed call leaves nothing running behind it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

from shared.agents.registry import ToolContext
from shared.observability import metrics
from shared.settings import get_settings
from workers import cancels, step_pool
from workers.tool_processes import frames, groups

log = logging.getLogger("ratchet.worker")
FIRST_COUNT_SECONDS = 0.01  # a call's processes are first counted after this, then ...
COUNT_EVERY_SECONDS = 0.1  # ... twice as long after each count, up to this
REAP_SECONDS = 5.0  # a process whose pipe ended gets this long to exit before it is killed
MIB = 1024 * 1024


class NotRun(Exception):
    """The call never reached a tool process: none could start, or none was free in time."""


class Stopped(Exception):
    """The call's tool process was killed, or died, while the call ran: its outcome is
    unknown, but it does nothing more."""


def call(tool: str, arguments: dict[str, Any], context: ToolContext, *, timeout: float) -> Any:
    """Run a call of ``tool`` in a tool process, at most ``timeout`` s; its outcome as data
    (``Outcome.to_wire``).

    Raises :class:`NotRun` when no process took the call within ``timeout`` s,
    :class:`Stopped` when its process was killed or died under it, and
    :class:`cancels.Interrupted` when its task was cancelled meanwhile (the process killed).
    """
    settings = get_settings()
    pool = current()
    watch = cancels.current()
    process = pool.acquire(wait=timeout, watch=watch)
    request = {
        "tool": tool,
        "arguments": arguments,
        "context": {
            "task_id": context.task_id,
            "tenant_id": context.tenant_id,
            "call_id": context.call_id,
            "idempotency_key": context.idempotency_key,
            "secrets": dict(context.secrets),
        },
        "cpu_seconds": settings.tool_process_cpu_seconds,
    }
    try:
        with watch.stopping(partial(process.kill, "cancel")) if watch else nullcontext():
            reply = process.call(
                request, timeout=timeout, max_processes=settings.tool_process_max_processes
            )
    except BaseException:
        pool.discard(process)
        _raise_if_cancelled(watch)
        raise
    if watch is not None and watch.cancelled.is_set():
        process.kill("cancel")  # it answered, but its step has stopped waiting for it
        pool.discard(process)
        _raise_if_cancelled(watch)
    pool.release(process, reply)
    return reply["outcome"]


def _raise_if_cancelled(watch: cancels.Watch | None) -> None:
    """A cancel of the task wins over the call's own end, as for a call on a thread."""
    if watch is not None and watch.cancelled.is_set():
        raise cancels.Interrupted(f"task {watch.task_id} was cancelled")


class ToolProcess:
    """One tool process: its pipes, its calls so far, and why it was killed, if it was."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None
        assert proc.stdout is not None
        self.proc = proc
        self.pid = proc.pid
        self.calls = 0
        self.killed: str | None = None
        self._requests = proc.stdin.fileno()
        os.set_blocking(proc.stdout.fileno(), False)
        self.reader = frames.Reader(proc.stdout.fileno())
        self._lock = threading.Lock()
        self._reaped = False

    @classmethod
    def start(cls, *, memory_mb: int, timeout: float, env: dict[str, str]) -> ToolProcess:
        """A new tool process, once it has imported the registry and said so."""
        command = [sys.executable, "-m", "workers.tool_processes.serve", "--memory-mb"]
        proc = subprocess.Popen(  # its own session: a process group it leads
            [*command, str(memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        process = cls(proc)
        try:
            process.reader.until(time.monotonic() + timeout)
        except (TimeoutError, frames.Closed) as exc:
            process.kill("start")
            process.end()
            why = "it hung" if isinstance(exc, TimeoutError) else process.status()
            raise NotRun(
                f"a tool process did not start within {timeout:g} s ({why}; its error, if it "
                "wrote one, is in the worker's log)"
            ) from exc
        metrics.tool_processes.labels(event="started").inc()
        return process

    def call(self, request: dict[str, Any], *, timeout: float, max_processes: int) -> Any:
        """Send ``request`` and wait for the reply: at most ``timeout`` s, and while the call
        runs at most ``max_processes`` descendants. Raises :class:`Stopped`."""
        try:
            frames.send(self._requests, request)
        except OSError as exc:  # it died between calls: the request never reached it
            self.end()
            raise NotRun(f"its tool process had ended ({self.status()})") from exc
        deadline = time.monotonic() + timeout
        try:
            # A call that answers at once (most do) keeps the step's turn; a longer one gives
            # it up while it runs, as a call on a thread does (``cancels.call``).
            if self.reader.wait(min(cancels.QUICK_SECONDS, timeout)):
                reply = self.reader.take()
                if reply is not None:
                    return reply
            with step_pool.waiting():
                return self._watch(deadline, timeout=timeout, max_processes=max_processes)
        except frames.Closed:
            self.end()
            raise Stopped(self.ending()) from None

    def _watch(self, deadline: float, *, timeout: float, max_processes: int) -> Any:
        interval = FIRST_COUNT_SECONDS
        count_at = time.monotonic() + interval
        while True:
            reply = self.reader.take()
            if reply is not None:
                return reply
            now = time.monotonic()
            if now >= deadline:
                self.kill("timeout")
                raise Stopped(f"timed out after {timeout:g} s: its tool process was killed")
            if now >= count_at:
                if groups.descendants(self.pid, past=max_processes) > max_processes:
                    self.kill("processes")
                    raise Stopped(
                        f"started more than {max_processes} processes "
                        "(RATCHET_TOOL_PROCESS_MAX_PROCESSES): its tool process was killed"
                    )
                interval = min(interval * 2, COUNT_EVERY_SECONDS)
                count_at = now + interval
            self.reader.wait(min(deadline, count_at) - now)

    def kill(self, reason: str) -> None:
        """Kill the process and its group (any thread may; the first reason is kept)."""
        with self._lock:
            self.killed = self.killed or reason
            if not self._reaped:
                groups.kill(self.pid)

    def end(self) -> None:
        """Make sure the process and its group are gone, and reap it."""
        if self.killed is None:  # its pipe ended: it is on its way out on its own
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(REAP_SECONDS)
        with self._lock:
            if self._reaped:
                return
            groups.kill(self.pid)
            self.proc.wait()
            groups.reap(self.pid)  # the rest of its group, as they die
            self._reaped = True
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def ending(self) -> str:
        """How the (ended) process ended, as the rest of a sentence about its call."""
        if self.killed == "cancel":
            return "was stopped by a cancel of its task: its tool process was killed"
        code = self.proc.returncode
        if code is not None and -code == signal.SIGXCPU:
            cpu = get_settings().tool_process_cpu_seconds
            return f"used more than {cpu} s of CPU: its tool process was ended (SIGXCPU)"
        return f"ended its tool process ({self.status()})"

    def status(self) -> str:
        """The (ended) process's exit status, or the signal that killed it."""
        code = self.proc.returncode
        if code is None or code >= 0:
            return f"exit status {code}"
        name = _signal_name(-code)
        if -code == signal.SIGKILL and self.killed is None:
            return f"killed by {name}: out of memory, or by hand"
        return f"killed by {name}"


class Pool:
    """Up to ``size`` tool processes of this worker process: those free, and how many live."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.settings = get_settings()
        self.closed = False
        self._free: list[ToolProcess] = []
        self._calling: set[ToolProcess] = set()
        self._live = 0
        self._changed = threading.Condition()
        groups.adopt_orphans()  # the processes of the groups it kills come back to be reaped

    def acquire(self, *, wait: float, watch: cancels.Watch | None = None) -> ToolProcess:
        """A free process (started if there is room for one); raises :class:`NotRun` if none
        frees up within ``wait`` s, and :class:`cancels.Interrupted` if ``watch``'s task is
        cancelled meanwhile. Waits, and starts processes, without the step's turn."""
        with self._changed:
            process = self._take_free()
        if process is None:
            with (
                step_pool.waiting(),
                watch.stopping(self._wake_all) if watch is not None else nullcontext(),
            ):
                process = self._wait_for_one(wait, watch)
        with self._changed:
            self._calling.add(process)
        return process

    @property
    def live(self) -> int:
        """How many processes this pool has (free, in a call, or starting)."""
        return self._live

    def calling(self) -> list[ToolProcess]:
        """The processes running a call now."""
        with self._changed:
            return list(self._calling)

    def _take_free(self) -> ToolProcess | None:
        while self._free:
            process = self._free.pop()
            if process.proc.poll() is None:
                return process
            self._live -= 1  # it died between calls (a subprocess of its killed it, say)
            process.end()
            log.warning("tool process %d ended between calls (%s)", process.pid, process.status())
        return None

    def _wake_all(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _wait_for_one(self, wait: float, watch: cancels.Watch | None) -> ToolProcess:
        deadline = time.monotonic() + wait
        with self._changed:
            while True:
                _raise_if_cancelled(watch)
                process = self._take_free()
                if process is not None:
                    return process
                if self._live < self.size:
                    self._live += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NotRun(
                        f"no tool process was free within {wait:g} s ({self.size} per worker "
                        "process: RATCHET_TOOL_PROCESS_POOL_SIZE)"
                    )
                self._changed.wait(left)
        settings = get_settings()
        try:
            return ToolProcess.start(
                memory_mb=settings.tool_process_memory_limit_mb,
                timeout=settings.tool_process_start_timeout_seconds,
                env=_environment(),
            )
        except BaseException:
            self._gone()
            raise

    def release(self, process: ToolProcess, reply: dict[str, Any]) -> None:
        """The call is over: keep the process for the next, unless it should be replaced."""
        process.calls += 1
        why = "its pool was closed" if self.closed else _replace_because(process, reply)
        if why is None:
            with self._changed:
                self._calling.discard(process)
                self._free.append(process)
                self._changed.notify()
            return
        log.info("ending tool process %d: %s", process.pid, why)
        metrics.tool_processes.labels(event="recycled").inc()
        process.kill("recycled")
        process.end()
        self._gone(process)

    def discard(self, process: ToolProcess) -> None:
        """The call failed with its process: make sure it is gone, and make room."""
        process.end()
        reason = process.killed or "crashed"
        if reason == "crashed":
            log.warning("tool process %d died under its call (%s)", process.pid, process.status())
        elif reason != "cancel":
            log.warning("tool process %d killed under its call (%s)", process.pid, reason)
        metrics.tool_processes.labels(event=reason).inc()
        self._gone(process)

    def _gone(self, process: ToolProcess | None = None) -> None:
        with self._changed:
            if process is not None:
                self._calling.discard(process)
            self._live -= 1
            self._changed.notify()

    def close(self) -> None:
        """End every free process (those in a call end with it)."""
        with self._changed:
            self.closed = True
            free, self._free = self._free, []
            self._live -= len(free)
        for process in free:
            process.kill("closed")
            process.end()


def _replace_because(process: ToolProcess, reply: dict[str, Any]) -> str | None:
    settings = get_settings()
    if reply.get("retire"):
        return "a tool ran out of memory in it"
    if process.calls >= settings.tool_process_max_calls:
        return f"it served {process.calls} calls (RATCHET_TOOL_PROCESS_MAX_CALLS)"
    rss = int(reply.get("rss") or 0)
    if rss > settings.tool_process_recycle_rss_mb * MIB:
        return f"it holds {rss // MIB} MiB (RATCHET_TOOL_PROCESS_RECYCLE_RSS_MB)"
    if groups.descendants(process.pid, past=0):
        return "its call left processes running"
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _environment() -> dict[str, str]:
    """The worker's environment, with its import path: a tool process imports the modules
    the worker imports, from where the worker found them."""
    paths = [path for path in sys.path if path and os.path.isdir(path)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


_pools: dict[int, Pool] = {}
_lock = threading.Lock()


def current() -> Pool:
    """This process's pool (after any fork, a child's tool processes are its own), made on
    first use from the settings in force, and made anew if they change (tests change them):
    its processes started with the environment, and the limits, of the settings before."""
    settings = get_settings()
    pool = _pools.get(os.getpid())
    if pool is None or pool.settings is not settings:
        with _lock:
            pool = _pools.get(os.getpid())
            if pool is None or pool.settings is not settings:
                if pool is not None:
                    pool.close()
                pool = _pools[os.getpid()] = Pool(settings.tool_process_pool_size)
    return pool


@contextmanager
def fresh_pool() -> Iterator[Pool]:
    """A pool of its own for the block, its processes ended after it (for tests and
    benchmarks)."""
    with _lock:
        previous = _pools.pop(os.getpid(), None)
    pool = current()
    try:
        yield pool
    finally:
        with _lock:
            last = _pools.pop(os.getpid(), None)
            if previous is not None:
                _pools[os.getpid()] = previous
        for made in {pool, last} - {None, previous}:
            if made is not None:
                made.close()
