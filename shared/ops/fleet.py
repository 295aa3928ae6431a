"""The fleet's live view: the processes that run steps, the queues, the sweeper's last run.

Every worker process that runs steps publishes a small record of itself every
``RATCHET_PRESENCE_INTERVAL_SECONDS`` (``workers/presence.py``). A record lives three
intervals, so a process that dies drops out of the view on its own, with nothing to clean up.
The sweeper records each run it makes. Where it is kept is the transport's
(``shared.transport``): in production Redis, one fleet per queue name (the workers that take
from that queue); under ``ratchet dev``, where the worker runs in the API's process, process
memory.

What the dashboard reads: :func:`view` (all of it at once), or :func:`live_workers`,
:func:`last_sweep`, :func:`queues` and :func:`oldest_runnable_task` one by one. Every one of
them may raise :class:`FleetUnavailable` (Redis does not answer); none of them writes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.errors import RatchetError
from shared.queue import oldest_waiting_ms, webhook_queue
from shared.settings import get_settings
from shared.statuses import RUNNABLE_STATUSES, in_order
from shared.store.db import now_ms
from shared.store.tables import Task
from shared.transport import Transport, TransportUnavailable, get_transport

log = logging.getLogger("ratchet.fleet")
MAX_RUNNING = 50  # task ids a record lists; ``busy`` still counts them all
MAX_WORKERS = 1000  # records one read returns: the most recently published
TTL_INTERVALS = 3  # a record outlives its process by at most this many intervals


class FleetUnavailable(RatchetError):
    """The fleet's live view cannot be read: Redis does not answer."""


@dataclass(frozen=True)
class WorkerRecord:
    """One process that runs steps, as it last described itself (times: epoch seconds)."""

    name: str  # the Celery worker's name (its hostname option, e.g. ``w1@host``)
    host: str
    pid: int
    worker_pid: int  # the worker's main process: ``pid`` itself unless the pool forks
    pool: str
    concurrency: int  # the worker's Celery concurrency (prefork: its processes)
    threads: int  # steps this process may run at once
    busy: int  # steps running now
    running: tuple[str, ...]  # their tasks' ids, at most MAX_RUNNING
    started_at: float
    last_seen: float

    @property
    def member(self) -> str:
        """This process's name in the index: unique across hosts and restarts."""
        return f"{self.host}/{self.pid}/{self.name}"

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: str | bytes) -> WorkerRecord:
        data = json.loads(raw)
        return cls(**{**data, "running": tuple(data["running"])})


@dataclass(frozen=True)
class SweepRecord:
    """The sweeper's last run that held the lock (``at``: epoch seconds)."""

    process: str  # the worker's name and the sweeping process's pid: ``w1@host/1234``
    at: float
    tasks_resent: int
    deliveries_resent: int

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: str | bytes) -> SweepRecord:
        return cls(**json.loads(raw))


@dataclass(frozen=True)
class QueueView:
    name: str
    kind: str  # "steps" or "webhooks"
    depth: int | None  # messages waiting; None when the broker cannot be looked into
    oldest_age_ms: int | None  # how long its next message has waited (see oldest_waiting_ms)


@dataclass(frozen=True)
class RunnableTask:
    """The runnable task (queued, or running without a live lease) due the longest."""

    id: str
    status: str
    due_at: datetime
    overdue_ms: int  # past its due time, on the database's clock (negative: not due yet)


@dataclass(frozen=True)
class FleetView:
    workers: list[WorkerRecord]
    queues: list[QueueView]
    oldest_runnable_task: RunnableTask | None
    sweeper: SweepRecord | None
    flower_url: str | None


class Fleet:
    """The live view of the fleet that takes from the queue ``name``, where the transport
    keeps it. Every method may raise :class:`FleetUnavailable`."""

    def __init__(self, transport: Transport, name: str) -> None:
        self.transport = transport
        self.presence = transport.presence(name)

    def publish(self, record: WorkerRecord, *, ttl_seconds: float) -> None:
        with _unavailable():
            self.presence.put(
                record.member, record.dumps(), seen_at=record.last_seen, ttl_seconds=ttl_seconds
            )

    def withdraw(self, record: WorkerRecord) -> None:
        with _unavailable():
            self.presence.remove(record.member)

    def workers(self) -> list[WorkerRecord]:
        with _unavailable():
            raws = self.presence.records(MAX_WORKERS)
        return [record for raw in raws if (record := _parse(WorkerRecord, raw))]

    def save_sweep(self, record: SweepRecord) -> None:
        with _unavailable():
            self.presence.put_sweep(record.dumps())

    def sweep(self) -> SweepRecord | None:
        with _unavailable():
            raw = self.presence.sweep()
        return _parse(SweepRecord, raw) if raw else None

    def depth(self, queue: str) -> int | None:
        """Messages waiting in ``queue``; None when the broker cannot be looked into."""
        with _unavailable():
            return self.transport.queue_depth(queue)


@contextmanager
def _unavailable() -> Iterator[None]:
    """Turns the transport's silence into :class:`FleetUnavailable`."""
    try:
        yield
    except TransportUnavailable as exc:
        raise FleetUnavailable(f"the fleet's live view is unavailable: {exc}") from exc


Record = TypeVar("Record", WorkerRecord, SweepRecord)


def _parse(kind: type[Record], raw: str | bytes) -> Record | None:
    try:
        return kind.loads(raw)
    except (ValueError, TypeError, KeyError):
        return None  # written by another version: left out, it expires


def get_fleet() -> Fleet:
    """The live view of this process's fleet (its queue name), on the transport."""
    return Fleet(get_transport(), get_settings().queue_name)


# --- what the worker side writes -------------------------------------------------------------


def publish(record: WorkerRecord) -> None:
    """Say ``record``'s process is alive, for three presence intervals."""
    ttl = TTL_INTERVALS * get_settings().presence_interval_seconds
    get_fleet().publish(record, ttl_seconds=ttl)


def withdraw(record: WorkerRecord) -> None:
    """Take ``record``'s process out of the view at once (it is stopping)."""
    get_fleet().withdraw(record)


def record_sweep(*, process: str, tasks_resent: int, deliveries_resent: int) -> None:
    """Keep a sweep that held the lock as the last one. Never raises: a sweep goes on
    whether or not the view can be written."""
    record = SweepRecord(process, time.time(), tasks_resent, deliveries_resent)
    try:
        get_fleet().save_sweep(record)
    except FleetUnavailable as exc:
        log.warning("sweep not recorded: %s", exc)


# --- what the dashboard reads ----------------------------------------------------------------


def live_workers() -> list[WorkerRecord]:
    """Every process that published within its TTL, by name and pid."""
    return sorted(get_fleet().workers(), key=lambda r: (r.name, r.host, r.pid))


def last_sweep() -> SweepRecord | None:
    """The sweeper's last run that held the lock, or None if none was recorded."""
    return get_fleet().sweep()


def queues() -> list[QueueView]:
    """The step queue and the webhook queue: how many messages wait, and for how long the
    next one has (None where the broker cannot tell: the in-process queue, or a message
    waiting longer than the visibility timeout, which ``oldest_waiting_ms`` disowns)."""
    settings = get_settings()
    fleet = get_fleet()
    views = []
    for name, kind in ((settings.queue_name, "steps"), (webhook_queue(settings), "webhooks")):
        depth = fleet.depth(name)
        sent = oldest_waiting_ms(name) if depth else None
        age = None if sent is None else max(0, int(time.time() * 1000) - sent)
        views.append(QueueView(name=name, kind=kind, depth=depth, oldest_age_ms=age))
    return views


def oldest_runnable_task(session: Session) -> RunnableTask | None:
    """The runnable task with no live lease whose next step has been due the longest: one
    short index scan of ``ix_tasks_status_due`` per runnable status."""
    clock = int(session.scalar(select(now_ms())) or 0)
    unleased = Task.lease_expires_ms.is_(None) | (Task.lease_expires_ms < clock)
    found = []
    for status in in_order(RUNNABLE_STATUSES):
        row = session.execute(
            select(Task.id, Task.status, Task.due_ms, Task.lease_expires_ms)
            .where(Task.status == status, Task.due_ms.is_not(None), unleased)
            .order_by(Task.due_ms)
            .limit(1)
        ).first()
        if row is not None:
            found.append(row)
    if not found:
        return None

    def since(row: Any) -> int:
        # A step leased in place keeps its task's older due time: it was due again only
        # once its lease ran out.
        return max(int(row.due_ms), int(row.lease_expires_ms or 0))

    oldest = min(found, key=since)
    due_ms = since(oldest)
    due_at = datetime.fromtimestamp(due_ms / 1000, UTC)
    return RunnableTask(oldest.id, oldest.status, due_at, clock - due_ms)


def view(session: Session) -> FleetView:
    """All of the live view, with the link to Flower if one is configured."""
    return FleetView(
        workers=live_workers(),
        queues=queues(),
        oldest_runnable_task=oldest_runnable_task(session),
        sweeper=last_sweep(),
        flower_url=get_settings().flower_url,
    )
