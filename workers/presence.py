"""Presence: each process that runs steps tells the fleet, every few seconds, who it is and
what it runs now (``shared.ops.fleet``), so the operator's live view lists it. A process that
dies stops telling, and drops out of the view three intervals later.

Celery names the worker in its main process (``worker_init``: :func:`configure`); a prefork
child inherits that name and publishes a record of its own, since the steps it runs, and
their leases, are its own. A pool that does not fork runs the steps, and publishes, in the
main process.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from shared.ops import fleet
from shared.ops.fleet import FleetUnavailable, WorkerRecord
from shared.settings import get_settings
from workers import heartbeat, step_pool

log = logging.getLogger("ratchet.presence")


@dataclass(frozen=True)
class Identity:
    """The worker this process belongs to, as Celery started it."""

    name: str
    pool: str
    concurrency: int
    worker_pid: int


_identity = Identity(f"ratchet@{socket.gethostname()}", "solo", 1, os.getpid())
# pid → (its publishing thread, the event that stops it, when it started)
_publishing: dict[int, tuple[threading.Thread, threading.Event, float]] = {}
_lock = threading.Lock()


def configure(worker: Any) -> None:
    """Name this process's worker after Celery's ``WorkController`` (in the main process,
    before any fork, so that the pool's children are named alike)."""
    global _identity  # noqa: PLW0603 - one worker per process
    concurrency = int(worker.concurrency or 1)
    _identity = Identity(str(worker.hostname), pool_name(worker.pool_cls), concurrency, os.getpid())


def pool_name(pool_cls: object) -> str:
    """Celery's name for a pool (``prefork``, ``threads``, ``solo``, …), given by name or
    by class."""
    if isinstance(pool_cls, str):
        return pool_cls
    from celery.concurrency import ALIASES  # type: ignore[attr-defined]  # not in the stubs

    target = f"{getattr(pool_cls, '__module__', '')}:{getattr(pool_cls, '__qualname__', '')}"
    return next((alias for alias, path in ALIASES.items() if path == target), target)


def forks() -> bool:
    """Whether the worker's steps run in forked children rather than its main process."""
    return _identity.pool == "prefork"


def process_name() -> str:
    """This process, for a record: its worker's name and its pid (``w1@host/1234``)."""
    return f"{_identity.name}/{os.getpid()}"


def record() -> WorkerRecord:
    """This process as it is now: its steps in flight and the tasks they run."""
    pool = step_pool.get_pool()
    entry = _publishing.get(os.getpid())
    now = time.time()
    return WorkerRecord(
        name=_identity.name,
        host=socket.gethostname(),
        pid=os.getpid(),
        worker_pid=_identity.worker_pid,
        pool=_identity.pool,
        concurrency=_identity.concurrency,
        threads=pool.threads,
        busy=pool.busy,
        running=tuple(heartbeat.held_tasks(fleet.MAX_RUNNING)),
        started_at=entry[2] if entry else now,
        last_seen=now,
    )


def publish_once() -> None:
    """Publish this process's record now. Never raises: the next interval tries again."""
    try:
        fleet.publish(record())
    except FleetUnavailable as exc:
        log.warning("presence not published: %s", exc)


def start() -> None:
    """Publish this process's record now and every interval after, until :func:`stop`. A
    second call in the same process does nothing."""
    pid = os.getpid()
    with _lock:
        if pid in _publishing:
            return
        stop_event = threading.Event()
        thread = threading.Thread(
            target=_run, args=(stop_event,), name="ratchet-presence", daemon=True
        )
        _publishing[pid] = (thread, stop_event, time.time())
    thread.start()


def _run(stop_event: threading.Event) -> None:
    interval = get_settings().presence_interval_seconds
    publish_once()
    while not stop_event.wait(interval):
        publish_once()


def stop() -> None:
    """At shutdown: stop publishing and leave the live view at once."""
    with _lock:
        entry = _publishing.pop(os.getpid(), None)
    if entry is None:
        return
    thread, stop_event, _ = entry
    stop_event.set()
    thread.join(timeout=2)  # so that no publish in flight lands after the withdrawal
    try:
        fleet.withdraw(record())
    except FleetUnavailable as exc:
        log.warning("presence not withdrawn (it expires on its own): %s", exc)
