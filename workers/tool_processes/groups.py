"""Process groups of tool processes: counting their members, killing them, reaping the dead.

A tool process leads a process group of its own, which the processes its tools start join.
Killing the group kills them all at once (the kernel delivers a group's signal to a fork in
flight too). Their corpses must still be reaped, or each stays a zombie holding its process
id: the orphans of a killed group go to the nearest child subreaper among their ancestors,
else to PID 1, which in a container is often a process that reaps nothing. So a worker
process that runs tool processes is a subreaper itself (:func:`adopt_orphans`) and reaps the
groups it killed, and only those (:func:`reap`): another child's exit status is not its own
to take.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("ratchet.worker")
PR_SET_CHILD_SUBREAPER = 36
REAP_EVERY_SECONDS = 0.1
REAP_FOR_SECONDS = 60.0  # a group whose members are still around after this is left be


def adopt_orphans() -> None:
    """Make this process the parent of its descendants' orphans (Linux; a no-op elsewhere)."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def kill(pgid: int) -> None:
    """SIGKILL every member of group ``pgid``; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def descendants(pid: int, *, past: int) -> int:
    """How many descendants ``pid`` has, counted from ``/proc`` up to ``past + 1`` at most
    (enough to know the count is past ``past``, without reading a fork bomb's every entry).
    0 where ``/proc`` cannot tell."""
    found = 0
    todo = [pid]
    while todo and found <= past:
        for child in _children(todo.pop()):
            found += 1
            todo.append(child)
    return found


def _children(pid: int) -> list[int]:
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children: list[int] = []
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children", "rb") as listed:
                children.extend(int(child) for child in listed.read().split())
        except OSError:
            continue
    return children


class Reaper:
    """Reaps the members of killed groups as they die and come to this process, on a thread
    of its own that runs while any such group is left."""

    def __init__(self) -> None:
        self._groups: dict[int, float] = {}  # pgid: when to give up on it
        self._lock = threading.Lock()
        self._running_in: int | None = None  # the process its thread runs in (none survive a fork)

    def add(self, pgid: int) -> None:
        """Reap group ``pgid``, whose leader this process has reaped already (its members
        could otherwise take its exit status)."""
        if _reap(pgid):
            return
        with self._lock:
            self._groups[pgid] = time.monotonic() + REAP_FOR_SECONDS
            if self._running_in == os.getpid():
                return
            self._running_in = os.getpid()
        threading.Thread(target=self._run, name="tool-process-reaper", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(REAP_EVERY_SECONDS)
            with self._lock:
                groups = list(self._groups.items())
            gone = [pgid for pgid, until in groups if _reap(pgid) or time.monotonic() > until]
            with self._lock:
                for pgid in gone:
                    self._groups.pop(pgid, None)
                if not self._groups:
                    self._running_in = None
                    return


def _reap(pgid: int) -> bool:
    """Kill and reap what is left of group ``pgid``; whether it is gone."""
    kill(pgid)  # a member forked while the last kill flew
    waitid = getattr(os, "waitid", None)
    while waitid is not None:
        try:
            if waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG) is None:
                break
        except ChildProcessError:  # none of its members is a child of this process (yet)
            break
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return True  # its id is another user's group now
    return False


_reaper = Reaper()


def reap(pgid: int) -> None:
    """Reap the members of the killed group ``pgid`` as they die (its leader reaped)."""
    _reaper.add(pgid)
