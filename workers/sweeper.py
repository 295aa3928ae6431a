"""The sweeper: re-enqueues runnable tasks whose next step is overdue and unleased.

A message can be lost: a worker killed with its message unacked (Redis hands it back only
after the visibility timeout), a Redis restart or flush, a crash between the API's commit
and its publish. Postgres still says the task is runnable, so the sweeper sends a new
message. Extra messages are harmless: a message for a committed step is dropped, and two
for the same step race for one lease. They are not free, though: a task or a delivery that
is only waiting behind a backlog keeps its message (see ``queue.oldest_waiting_ms``), and one
that got a new message gets no other for the grace.

Every worker process runs a sweeper thread; on Postgres an advisory lock lets one sweep
at a time.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy import text

from shared import outbox, task_store
from shared.db import transaction, write_session
from shared.queue import enqueue_deliveries, enqueue_step, oldest_waiting_ms, webhook_queue
from shared.settings import get_settings

log = logging.getLogger("ratchet.sweeper")
SWEEP_LOCK_ID = 0x5241544348  # "RATCH"


def sweep_once() -> int:
    """One pass: a new message for every task and webhook delivery whose message seems lost;
    returns how many it sent.

    The sweep's transaction only reads, so a sweeper stopped in it (a frozen VM) holds no
    task's row; each overdue task is then claimed by one autocommit statement.
    """
    settings = get_settings()
    grace_ms = int(settings.sweep_grace_seconds * 1000)
    steps_before = oldest_waiting_ms(settings.queue_name)
    sends_before = oldest_waiting_ms(webhook_queue(settings))
    with transaction() as session:
        if session.get_bind().dialect.name == "postgresql":
            # One sweeper at a time; and a row locked by a stalled transaction must not stall
            # the fleet's sweeping, so this transaction waits for locks 5 s at most.
            got = session.scalar(
                text(
                    "SELECT pg_try_advisory_xact_lock(:id)"
                    " AND set_config('lock_timeout', '5s', true) IS NOT NULL"
                ),
                {"id": SWEEP_LOCK_ID},
            )
            if not got:
                return 0
        candidates = task_store.due_for_sweep(
            session, grace_ms=grace_ms, sent_before_ms=steps_before
        )
        lost_sends = outbox.due(session, grace_ms=grace_ms, sent_before_ms=sends_before)
    with write_session() as session:
        ids = [task_id for task_id, _ in candidates]
        overdue = task_store.mark_redispatched(
            session, ids, grace_ms=grace_ms, sent_before_ms=steps_before
        )
        deliveries = outbox.mark_redispatched(
            session, lost_sends, grace_ms=grace_ms, sent_before_ms=sends_before
        )
    for task_id, step in overdue:
        enqueue_step(task_id, step)
    enqueue_deliveries(deliveries)
    if overdue:
        log.warning("sweeper re-enqueued %d task(s)", len(overdue))
    return len(overdue) + len(deliveries)


def run(stop: threading.Event) -> None:
    interval = get_settings().sweep_interval_seconds
    while not stop.wait(interval):
        try:
            sweep_once()
        except Exception:
            log.exception("sweep failed; trying again in %s s", interval)


def start() -> threading.Event:
    stop = threading.Event()
    threading.Thread(target=run, args=(stop,), name="ratchet-sweeper", daemon=True).start()
    return stop
