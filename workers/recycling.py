"""Recycling: a worker process wedged by calls it cannot stop leaves, and a fresh one replaces it.

A model or tool call that overruns its deadline is abandoned, but Python cannot stop a thread:
the call keeps its thread until it returns, if ever. Once ``RATCHET_WORKER_MAX_ABANDONED_CALLS``
of a process's calls are abandoned and still running (``cancels.on_wedged``), the process no
longer trusts itself with work and leaves:

- it takes no new step: a message in hand is held until the process exits, and then Celery's
  prefork parent puts it back on the queue (late acks, reject on worker lost);
- a step in flight that commits stops there: the task's next step goes back on the queue;
- its heartbeat stops extending its leases, so those of steps stuck in their calls run out and
  the sweeper resumes their tasks elsewhere, from their last commit;
- it leaves the fleet's live view, so the dispatcher no longer counts its threads;
- it gives its steps in flight up to ``RATCHET_SHUTDOWN_GRACE_SECONDS`` to commit, then exits,
  and the prefork parent starts a fresh child in its place.

Only a prefork child is recycled: a process whose steps run in the worker's main process (a
threads or solo pool, ``ratchet dev``) would take the whole worker down, so it logs the
warning and goes on.
"""

from __future__ import annotations

import logging
import os
import threading

from shared.settings import get_settings
from workers import heartbeat, presence, step_pool

log = logging.getLogger("ratchet.worker")
_leaving = threading.Event()


def leaving() -> bool:
    """Whether this process is on its way out (it takes no new step)."""
    return _leaving.is_set()


def recycle(reason: str) -> None:
    """Start leaving, in a thread of its own (the caller is a step: it returns at once)."""
    if not presence.forks():
        log.warning("this worker process is wedged: %s; restart it", reason)
        return
    if _leaving.is_set():
        return
    _leaving.set()
    log.warning(
        "recycling worker process %d: %s; it takes no new steps, lets its leases run out and "
        "exits, and a fresh process replaces it",
        os.getpid(),
        reason,
    )
    threading.Thread(target=_leave, name="ratchet-recycle", daemon=True).start()


def hold() -> None:
    """Keep a message taken while leaving until the process exits: it then goes back on the
    queue for another process (handed to the step pool here, it would be lost with it)."""
    threading.Event().wait()


def _leave() -> None:
    heartbeat.let_go()
    presence.stop()
    step_pool.drain(get_settings().shutdown_grace_seconds)
    for handler in logging.getLogger().handlers:
        handler.flush()  # its last lines reach the log before the exit
    os._exit(0)
