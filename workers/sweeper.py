"""The sweeper: re-enqueues runnable tasks whose next step is overdue and unleased.

A message can be lost: a worker killed with its message unacked (Redis hands it back only
after the visibility timeout), a Redis restart or flush, a crash between the API's commit
and its publish. Postgres still says the task is runnable, so the sweeper sends a new
message. Extra messages are harmless: a message for a committed step is dropped, and two
for the same step race for one lease. They are not free, though: a task or a delivery that
is only waiting behind a backlog keeps its message (see ``queue.oldest_waiting_ms``), and one
that got a new message gets no other for the grace.

It also applies the policy of every approval past its deadline (reject, approve, or fail the
task), exactly once whatever else decides at the same moment, and removes the ``run_python``
workspaces of this host's tasks that ended.

Every worker process runs a sweeper thread; on Postgres an advisory lock lets one sweep
at a time. Each sweep that held the lock is recorded for the operator's live view
(``shared.ops.fleet``): when, by which process, and what it sent again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Sequence

from sqlalchemy import select

from shared.actions import approvals
from shared.actions import waits as wait_actions
from shared.actions.effects import Effects, after_commit
from shared.approvals import decisions
from shared.ops import fleet
from shared.queue import oldest_waiting_ms, webhook_queue
from shared.sandbox import workspaces
from shared.settings import get_settings
from shared.store import tasks
from shared.store import waits as store_waits
from shared.store.backends import backend_of, write_session
from shared.store.db import get_sessionmaker, now_ms, transaction
from shared.webhooks import deliveries as webhook_deliveries
from workers import presence

log = logging.getLogger("ratchet.sweeper")
SWEEP_LOCK_ID = 0x5241544348  # "RATCH"
# A row's due time is written just before its message is sent, on another clock: a row due
# this much before the oldest waiting message may still have its message behind it.
SEND_ORDER_MARGIN_MS = 2_000


def sweep_once() -> int:
    """One pass: a new message for every task and webhook delivery whose message seems lost;
    returns how many it sent.

    The sweep's transaction only reads, so a sweeper stopped in it (a frozen VM) holds no
    task's row; each overdue task is then claimed by one autocommit statement.
    """
    settings = get_settings()
    grace_ms = int(settings.sweep_grace_seconds * 1000)
    with transaction() as session:
        if not backend_of(session).try_sweep_lock(session, SWEEP_LOCK_ID):
            return 0  # another process is sweeping: it looks into the queues, not this one
        steps_sent = oldest_waiting_ms(settings.queue_name)
        sends_sent = oldest_waiting_ms(webhook_queue(settings))
        # Rows hold the database's clock, messages their sender's: compare on the database's.
        offset = int(session.scalar(select(now_ms())) or 0) - int(time.time() * 1000)
        steps_before = _waiting_since(steps_sent, offset)
        sends_before = _waiting_since(sends_sent, offset)
        candidates = tasks.due_for_sweep(session, grace_ms=grace_ms, sent_before_ms=steps_before)
        lost_sends = webhook_deliveries.due(session, grace_ms=grace_ms, sent_before_ms=sends_before)
        expired = decisions.due(session)
        waits_due = store_waits.due(session)
        children_ended = store_waits.children_ended(session)
        unparked = store_waits.waiting_without_pending(session)
    expire_approvals(expired)
    settle_waits(waits_due, children_ended, unparked)
    with write_session() as session:
        ids = [task_id for task_id, _ in candidates]
        overdue = tasks.mark_redispatched(
            session, ids, grace_ms=grace_ms, sent_before_ms=steps_before
        )
        deliveries = webhook_deliveries.mark_redispatched(
            session, lost_sends, grace_ms=grace_ms, sent_before_ms=sends_before
        )
    after_commit(Effects(steps=tuple(overdue), deliveries=tuple(deliveries)))
    if overdue:
        log.warning("sweeper re-enqueued %d task(s)", len(overdue))
    fleet.record_sweep(
        process=presence.process_name(),
        tasks_resent=len(overdue),
        deliveries_resent=len(deliveries),
    )
    return len(overdue) + len(deliveries)


def expire_approvals(expired: Sequence[tuple[str, str, str]]) -> None:
    """Apply each deadline's policy, each call in a transaction of its own: a decision that
    got there first wins, and the deadline changes nothing."""
    for task_id, call_id, policy in expired:
        with get_sessionmaker()() as session:
            effects = approvals.expire(session, task_id, call_id, policy)
        log.info("approval of %s %s timed out: %s", task_id, call_id, policy)
        after_commit(effects)


def settle_waits(
    due: Sequence[tuple[str, str]], children_ended: Sequence[str], unparked: Sequence[str]
) -> None:
    """Durable waits: apply the policy of those past their deadline; and, as a backstop for
    a crash between a child's end (or a last settling) and its parent's, settle the parents'
    waits on children that ended, and resume waiting tasks that have nothing pending. Each
    in a transaction of its own: whatever got there first wins, and this changes nothing."""
    for token, task_id in due:
        with get_sessionmaker()() as session:
            after_commit(wait_actions.expire(session, token))
        log.info("wait %s of task %s timed out", token, task_id)
    for child_id in children_ended:
        with get_sessionmaker()() as session:
            after_commit(wait_actions.settle_child(session, child_id))
    for task_id in unparked:
        with get_sessionmaker()() as session:
            after_commit(wait_actions.after_parking(session, task_id))


def _waiting_since(sent_ms: int | None, offset_ms: int) -> int | None:
    """The oldest waiting message's send time on the database's clock, less a margin for a
    message published just after its commit and for clocks a little apart."""
    if sent_ms is None:
        return None
    return sent_ms + offset_ms - SEND_ORDER_MARGIN_MS


def sweep_workspaces() -> int:
    """Remove this host's workspaces of tasks that ended: every process does it for its own
    host (a workspace lives where its code ran), without the sweep lock."""

    def ended(task_ids: Collection[str]) -> list[str]:
        with transaction() as session:
            return tasks.ended_among(session, list(task_ids))

    return workspaces.sweep(ended)


def run(stop: threading.Event) -> None:
    interval = get_settings().sweep_interval_seconds
    while not stop.wait(interval):
        try:
            sweep_once()
            sweep_workspaces()
        except Exception:
            log.exception("sweep failed; trying again in %s s", interval)


def start() -> threading.Event:
    stop = threading.Event()
    threading.Thread(target=run, args=(stop,), name="ratchet-sweeper", daemon=True).start()
    return stop
