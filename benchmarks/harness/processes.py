"""The processes a benchmark starts, and what ``/proc`` says they cost.

Every server or worker runs as a subprocess of its own, in a process group of its own, so the
CPU and memory read from ``/proc`` are its alone and stopping it reaches every process it
forked. A Celery worker under measurement is steered by remote control (``Worker``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from celery import Celery

STOP_SECONDS = 30.0
POLL_SECONDS = 0.1
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Child:
    """``python -m ARGS`` in a process group of its own, its stderr (and, with
    ``keep_stdout``, its stdout) kept in a temporary file so a failure to start or a crash can
    say why."""

    def __init__(self, *args: str, env: dict[str, str], keep_stdout: bool = False) -> None:
        self.name = " ".join(args[:2])
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", *args],
            env=env,
            stdout=self.log if keep_stdout else subprocess.DEVNULL,
            stderr=self.log,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, chars: int = 3000) -> str:
        self.log.seek(0, os.SEEK_END)
        self.log.seek(max(0, self.log.tell() - chars))
        return self.log.read().decode(errors="replace")

    def check(self) -> None:
        """Raise, with the end of its log, if the process has exited."""
        code = self.popen.poll()
        if code is not None:
            raise RuntimeError(f"{self.name} exited with {code}:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM (a graceful shutdown), then SIGKILL to whatever is left of its group: a
        slow shutdown, or a worker's pool processes outliving it."""
        if self.popen.poll() is None:
            self.popen.terminate()
            with suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=STOP_SECONDS)
        with suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        self.log.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def wait_until(check: Callable[[], bool], *, what: str, child: Child, seconds: float) -> None:
    """Wait until ``check()`` holds; fail, showing the end of ``child``'s log, as soon as the
    child exits or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while not check():
        code = child.popen.poll()
        if code is not None or time.monotonic() > deadline:
            why = f"it exited ({code})" if code is not None else f"not within {seconds:.0f} s"
            raise RuntimeError(f"{what}: {why}; its output ends:\n{child.tail()}")
        time.sleep(POLL_SECONDS)


def answers_ok(url: str) -> bool:
    """Whether ``url`` answers 200 now."""
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ok(url: str, child: Child, *, seconds: float = 60.0) -> None:
    """Poll ``url`` until it answers 200; fail at once if ``child`` exits."""
    wait_until(lambda: answers_ok(url), what=f"{url} not ready", child=child, seconds=seconds)


# --- /proc -------------------------------------------------------------------------------


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces):
    index 1 is the parent's PID, 11 to 14 are utime, stime, cutime and cstime. None if the
    process ended while we looked."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rsplit(")", 1)[1].split()


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant (prefork children, their children)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := stat_fields(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, pending = [], [root]
    while pending:
        pid = pending.pop()
        found.append(pid)
        pending += children.get(pid, [])
    return found


def cpu_seconds(pids: Sequence[int], *, reaped: bool = False) -> float:
    """User + system time of these processes so far; with ``reaped``, also that of the
    children they waited for (a prefork worker's pool processes come and go)."""
    end = 15 if reaped else 13
    ticks = 0
    for pid in pids:
        if (fields := stat_fields(pid)) is not None:
            ticks += sum(int(value) for value in fields[11:end])
    return ticks / CLOCK_TICKS


def tree_cpu_seconds(root: int) -> float:
    """CPU time of ``root``, its live descendants and the children they reaped: a prefork
    worker's whole cost, however its pool processes come and go."""
    return cpu_seconds(process_tree(root), reaped=True)


def rss_mb(pids: Sequence[int]) -> float:
    total_kb = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
        except OSError:
            continue
    return total_kb / 1024


def pg_sockets(pids: Sequence[int], *, port: int) -> int:
    """Established TCP connections to ``port`` whose sockets these processes hold: the
    Postgres connections of a process tree, whatever application name they carry."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            links = [os.readlink(e.path) for e in os.scandir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    wanted = f":{port:04X}"
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            count += cols[2].endswith(wanted) and cols[3] == "01" and cols[9] in inodes
    return count


def machine_busy_seconds() -> float:
    """CPU time the whole machine spent busy (all cores): a worker's share plus Postgres,
    Redis and anything else running, which the worker's own figure leaves out."""
    with open("/proc/stat") as handle:
        ticks = [int(value) for value in handle.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle and iowait
    return (sum(ticks[:8]) - idle) / CLOCK_TICKS


def background_cores(seconds: float = 2.0) -> float:
    """Cores kept busy while a benchmark's processes sit idle: load from elsewhere that the
    measured runs share the machine with (a figure to read the others by)."""
    before = machine_busy_seconds()
    time.sleep(seconds)
    return (machine_busy_seconds() - before) / seconds


@dataclass
class Worker:
    """A Celery worker steered by remote control: paused while a backlog is loaded, so a
    measurement covers executing the backlog and nothing before it.

    ``queue`` is the measured queue; ``others`` the rest the worker consumes (Ratchet's
    webhooks queue). Pausing stops them all and resuming takes the measured queue first:
    a worker still waiting on another queue would only add the measured one at the end of
    that wait (the broker's blocking pop lasts up to a second), not when it is resumed."""

    control: Celery
    hostname: str
    queue: str
    child: Child
    others: tuple[str, ...] = ()

    def wait_ready(self) -> None:
        def answers() -> bool:
            return bool(self.control.control.ping(destination=[self.hostname], timeout=0.5))

        what = f"worker {self.hostname} did not start"
        wait_until(answers, what=what, child=self.child, seconds=120)

    def pause(self) -> None:
        for queue in (self.queue, *self.others):
            replies = self.control.control.cancel_consumer(
                queue, destination=[self.hostname], reply=True
            )
            self._check(replies, action="pause")

    def resume(self) -> None:
        for queue in (self.queue, *self.others):
            replies = self.control.control.add_consumer(
                queue, destination=[self.hostname], reply=True
            )
            self._check(replies, action="resume")

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.child.pid)

    def _check(self, replies: Any, *, action: str) -> None:
        if not any("ok" in reply.get(self.hostname, {}) for reply in replies or []):
            raise RuntimeError(f"worker {self.hostname} did not {action}: {replies!r}")
