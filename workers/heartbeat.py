"""Lease heartbeats: one thread per process keeps every lease it holds alive.

The heartbeat covers a step's long waits (a model call, a tool) by extending every lease that
has not been extended for a third of its TTL, all of them in one statement: however many
steps a process has in flight, a tick costs one round trip, on a connection of its own so
that it never waits behind the steps' writes for one. A lease found lost is dropped here,
and the step's next write stops the step.

A step that runs past ``RATCHET_STEP_TIME_LIMIT_SECONDS`` (stuck in a call that never
returns) is no longer kept alive: its lease runs out, another worker resumes the task from its
last commit, and the stuck step, if it ever wakes, is fenced off. A process that is leaving
(``workers.recycling``) lets all of its leases go the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice

from shared.settings import get_settings
from shared.store.backends import write_session
from shared.store.leases import Lease, extend_leases
from workers import cancels

log = logging.getLogger("ratchet.heartbeat")
_lock = threading.Lock()
_extended = threading.Condition(_lock)  # notified when a tick has settled what it extended
_leases: dict[int, tuple[Lease, float, float]] = {}  # id → (lease, since, last extended)
LOST = float("-inf")  # "last extended" of a lease found lost: kept until its step lets it go
_thread: threading.Thread | None = None
_letting_go = threading.Event()
_tick_now = threading.Event()  # a step waits on its lease: tick without waiting for the next
TICK_SECONDS = 0.25
BATCH = 500  # leases per statement


@contextmanager
def kept(lease: Lease) -> Iterator[None]:
    """Keep ``lease`` alive while the block runs. Its age counts from when it was taken, not
    from when its step got here: a step that stalled on its way (a cold process reading its
    context on a busy machine) may have lost it before the heartbeat ever saw it."""
    _ensure_thread()
    with _lock:
        _leases[id(lease)] = (lease, lease.taken_at, lease.taken_at)
    try:
        yield
    finally:
        with _lock:
            _leases.pop(id(lease), None)


def holding(lease: Lease) -> bool:
    """Whether this process may still act for ``lease`` on something that costs money (a
    model call): the lease was taken or extended within half its TTL, and never found lost.

    A lease older than that may have run out while this process stalled, and another worker
    may have asked and committed already: the heartbeat is asked to extend it at once, and
    the answer waited for (half a TTL at most). Extended, it is held; found lost, or not
    extended in time (the process is letting its leases go), the step stops as fenced. A
    lease this module does not keep (a step run outside a worker) is taken at its word."""
    limit = lease.ttl_ms / 2000
    deadline = time.monotonic() + limit
    with _extended:
        while True:
            entry = _leases.get(id(lease))
            if entry is None:
                return True
            if entry[2] == LOST:
                return False
            now = time.monotonic()
            if now - entry[2] < limit:
                return True
            if now >= deadline:
                return False
            _tick_now.set()
            _extended.wait(deadline - now)


def held_tasks(limit: int) -> list[str]:
    """The tasks whose leases this process keeps now (at most ``limit`` of them)."""
    with _lock:
        return [lease.task_id for lease, _, _ in islice(_leases.values(), limit)]


def _ensure_thread() -> None:
    global _thread  # noqa: PLW0603 - one heartbeat thread per process
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="ratchet-heartbeat", daemon=True)
            _thread.start()


def _due() -> list[Lease]:
    now, limit = time.monotonic(), get_settings().step_time_limit_seconds
    with _lock:
        for key, (lease, since, at) in list(_leases.items()):
            if at != LOST and now - since > limit:
                _leases[key] = (lease, since, LOST)
                log.error(
                    "step %d of task %s ran past the %d s step time limit: its lease is let go",
                    lease.step,
                    lease.task_id,
                    limit,
                    extra={"task_id": lease.task_id, "lease_epoch": lease.epoch},
                )
        return [
            lease
            for lease, _, at in _leases.values()
            if at != LOST and now - at >= lease.ttl_ms / 3000
        ]


def extend(leases: list[Lease]) -> None:
    """Extend these leases, a statement per batch of the same TTL; forget the lost ones."""
    by_ttl: dict[int, list[Lease]] = defaultdict(list)
    for lease in leases:
        by_ttl[lease.ttl_ms].append(lease)
    for ttl_ms, group in by_ttl.items():
        for start in range(0, len(group), BATCH):
            _extend_batch(group[start : start + BATCH], ttl_ms=ttl_ms)


def _extend_batch(leases: list[Lease], *, ttl_ms: int) -> None:
    sent = time.monotonic()  # an extended lease runs out ``ttl_ms`` after this at the latest
    try:
        # One statement (no transaction left open), on a connection of the heartbeat's own.
        with write_session(heartbeat=True) as session:
            held = extend_leases(session, leases, ttl_ms=ttl_ms)
    except Exception:
        log.exception("heartbeat of %d lease(s) failed", len(leases))
        return
    with _extended:
        for lease in leases:
            kept_since = _leases.get(id(lease))
            if kept_since is None:
                continue  # its step ended meanwhile
            at = sent if (lease.task_id, lease.epoch) in held else LOST
            _leases[id(lease)] = (lease, kept_since[1], at)
        _extended.notify_all()
    for (task_id, _), cancel_requested in held.items():
        if cancel_requested:  # in case its wake-up was lost
            cancels.cancel(task_id)


def let_go() -> None:
    """Extend no lease of this process any more: it is leaving. The leases of its steps still
    running then run out, and the sweeper resumes their tasks elsewhere."""
    _letting_go.set()


def _run() -> None:
    while True:
        _tick_now.wait(TICK_SECONDS)
        _tick_now.clear()
        try:
            due = _due()
            if due and not _letting_go.is_set():
                extend(due)
        except Exception:
            # The process's one heartbeat must outlive any one tick: a thread that died here
            # would let every lease of the process run out.
            log.exception("a heartbeat tick failed; the next one tries again")
