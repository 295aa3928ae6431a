"""Lease heartbeats: one thread per process keeps every lease it holds alive.

A lease is extended by every write of its step; the heartbeat covers the gaps, a long model
call or tool, by extending any lease that has not been touched for a third of its TTL. A lease
found lost is dropped here and the step's next write stops the step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from shared import task_store
from shared.db import write_session
from shared.errors import LeaseLost
from shared.task_store import Lease

log = logging.getLogger("ratchet.heartbeat")
_lock = threading.Lock()
_leases: dict[int, tuple[Lease, float]] = {}  # id(lease) → (lease, when last extended)
_thread: threading.Thread | None = None
TICK_SECONDS = 0.25


@contextmanager
def kept(lease: Lease) -> Iterator[None]:
    """Keep ``lease`` alive while the block runs."""
    _ensure_thread()
    with _lock:
        _leases[id(lease)] = (lease, time.monotonic())
    try:
        yield
    finally:
        with _lock:
            _leases.pop(id(lease), None)


def _ensure_thread() -> None:
    global _thread  # noqa: PLW0603 - one heartbeat thread per process
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="ratchet-heartbeat", daemon=True)
            _thread.start()


def _due() -> list[Lease]:
    now = time.monotonic()
    with _lock:
        return [lease for lease, since in _leases.values() if now - since >= lease.ttl_ms / 3000]


def _extend(lease: Lease) -> None:
    try:
        with write_session() as session:  # one statement: no transaction left open
            task_store.fence(session, lease)
    except LeaseLost:
        with _lock:
            _leases.pop(id(lease), None)
        return
    except Exception:
        log.exception("heartbeat failed", extra={"task_id": lease.task_id})
        return
    with _lock:
        if id(lease) in _leases:
            _leases[id(lease)] = (lease, time.monotonic())


def _run() -> None:
    while True:
        time.sleep(TICK_SECONDS)
        for lease in _due():
            _extend(lease)
