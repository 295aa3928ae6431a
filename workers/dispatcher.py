"""The dispatcher: admits waiting tasks from the backlog into the Celery queue, and fires the
schedules (``shared.scheduling``).

Every worker runs a dispatcher thread; one leads the fleet at a time (``shared.scheduling
.lead``: a lease on a row, renewed while the leader lives, for
``RATCHET_SWEEP_INTERVAL_SECONDS``). When the leader dies, even by ``kill -9``, its lease runs
out and another worker takes the lead at its next try: admission resumes within the sweep
interval. Each round takes a transaction-scoped lock, so two rounds never overlap even in the
moment a frozen leader wakes up. Embedded (one process), the dispatcher always leads.

The leader runs a round whenever it is woken (a submission, a retry, a decision) and every
``RATCHET_DISPATCH_INTERVAL_SECONDS`` while work waits (slots free up as steps end, backoffs
and ``run_at`` times come due); otherwise a few times a second. It uses the process's pool
of database connections, a statement at a time: leading holds no connection.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from sqlalchemy import update
from sqlalchemy.orm import Session

from shared.actions import schedules as schedule_actions
from shared.actions.effects import Effects, after_commit
from shared.ops import fleet
from shared.ops.fleet import FleetUnavailable
from shared.scheduling import admission, concurrency, gate, lead, schedules
from shared.scheduling.wake import Waiter
from shared.settings import get_settings
from shared.store import tenants, threads
from shared.store.db import get_sessionmaker, transaction
from shared.store.tables import Schedule

log = logging.getLogger("ratchet.dispatch")
LEAD = "dispatch"  # one leader per queue name (a fleet): ``dispatch:<queue>``
IDLE_SECONDS = 0.25  # how often the leader looks with nothing waiting (run_at, schedules)
CAPACITY_CACHE_SECONDS = 1.0


class Dispatcher:
    """One process's dispatcher: leads (and admits) or waits to lead."""

    def __init__(self) -> None:
        self.settings = get_settings()
        self.owner = f"{socket.gethostname()}/{os.getpid()}/{id(self):x}"
        self.lead_name = f"{LEAD}:{self.settings.queue_name}"
        self.rotation = admission.Rotation()
        self.gate = gate.Gatekeeper()
        self.ttl_ms = int(self.settings.sweep_interval_seconds * 1000)
        self._renewed = 0.0  # when this process last renewed its lead (monotonic)
        self._capacity: tuple[float, int] | None = None
        self._tenants: tuple[float, int] | None = None  # (when read, how many tenants)
        self._schedules_checked = -IDLE_SECONDS  # when due schedules were last looked for
        self.admitted = 0  # tasks this process admitted (for the logs)
        self.fired = 0

    def lead(self) -> bool:
        """Whether this process leads now: renews its lead a third of the way through, or
        takes the lead if it ran out."""
        now = time.monotonic()
        if now - self._renewed < self.ttl_ms / 3000:
            return True
        with transaction() as session:
            held = lead.claim(session, self.lead_name, self.owner, ttl_ms=self.ttl_ms)
        if held and not self._renewed:
            log.info("this process leads the dispatch")
        self._renewed = now if held else 0.0
        return held

    def resign(self) -> None:
        """Give the lead up (if held), so that another process takes it at once."""
        if self._renewed:
            self._renewed = 0.0
            self.gate.close()  # no leader to keep the gate: through the backlog till the next
            try:
                with transaction() as session:
                    lead.release(session, self.lead_name, self.owner)
            except Exception:
                log.debug("could not give the lead up; it runs out", exc_info=True)

    # --- one round ------------------------------------------------------------------------

    def slots(self) -> int:
        """The fleet's slots: the setting, else the live workers' threads (read once a second;
        0 while none is known, and then read again at the next round)."""
        if self.settings.dispatch_capacity is not None:
            return self.settings.dispatch_capacity
        now = time.monotonic()
        if self._capacity is not None and now - self._capacity[0] < CAPACITY_CACHE_SECONDS:
            return self._capacity[1]
        try:
            threads = sum(w.threads for w in fleet.live_workers())
        except FleetUnavailable:
            threads = 0
        if threads:
            self._capacity = (now, threads)
        return threads

    def capacity(self, slots: int) -> int:
        """How many tasks may be admitted at once: the fleet's ``slots``, never less than the
        window, so that a fleet starting up finds work waiting."""
        return max(slots, self.settings.dispatch_window)

    def share(self, slots: int) -> int | None:
        """The most slots a tenant with no ``max_running`` of its own may hold: its default
        share of the fleet's ``slots`` (of the capacity while no worker is known), at least
        one; None with fair scheduling off or a share of 1 (one FIFO, or no default share)."""
        fraction = self.settings.tenant_default_share
        if not self.settings.fair_scheduling or fraction >= 1:
            return None
        return max(1, int(fraction * (slots or self.capacity(slots))))

    def neighbours(self, session: Session) -> bool:
        """Whether the fleet serves two tenants or more: a share is room kept for a neighbour,
        so a lone tenant (``ratchet dev``'s, a single-tenant install) has the whole fleet.

        Read in the round itself while the answer is no, so a tenant created a moment ago has
        its share before any of the first tenant's next tasks is admitted; a yes is kept for a
        second (tenants are rarely deleted, and a round then spares the count)."""
        now = time.monotonic()
        fresh = self._tenants is not None and now - self._tenants[0] < CAPACITY_CACHE_SECONDS
        if not (fresh and self._tenants is not None and self._tenants[1] > 1):
            self._tenants = (now, tenants.count_tenants(session))
        return self._tenants[1] > 1

    def broker_full(self) -> bool:
        """Whether the broker still holds half the window or more: then workers have plenty
        to take, and a round now would admit a handful at a round's cost. Waiting for the
        queue to drain makes rounds fewer and larger; a tenant's new task still waits for at
        most about one window's worth of work ahead of it."""
        try:
            depth = fleet.get_fleet().depth(self.settings.queue_name)
        except FleetUnavailable:
            return False
        return depth is not None and depth >= max(1, self.settings.dispatch_window // 2)

    def round(self) -> admission.Round:
        """Fire due schedules (a few times a second), then admit what has room; send the
        messages once committed."""
        now = time.monotonic()
        if now - self._schedules_checked >= IDLE_SECONDS:
            self._schedules_checked = now
            self.fire_schedules()
        slots = self.slots()
        unseen = self.gate.close()  # what went direct lately may not be committed yet
        with transaction() as session:
            lead.lock_round(session)
            threads.release_held(session)  # a thread's next turn, once the one before it ended
            found = admission.admission_round(
                session,
                limits=concurrency.cached(session),
                capacity=self.capacity(slots),
                window=self.settings.dispatch_window,
                fair=self.settings.fair_scheduling,
                rotation=self.rotation,
                share=self.share(slots) if self.neighbours(session) else None,
                gate_share=self.share(slots),
                unseen=unseen,
            )
        # One not sent is admitted with no message: the sweeper sends it one after its grace.
        after_commit(Effects(steps=tuple(found.admitted)))
        self.gate.open(found.spare)  # so many may skip the backlog: nothing waits
        self.admitted += len(found.admitted)
        return found

    def fire_schedules(self) -> None:
        grace_ms = int(self.settings.schedule_misfire_grace_seconds * 1000)
        with transaction() as session:
            due = schedules.due(session)
        for schedule_id in due:
            try:
                with get_sessionmaker()() as session:
                    done = schedule_actions.fire(session, schedule_id, grace_ms=grace_ms)
            except Exception as exc:
                log.exception("schedule %s did not fire", schedule_id)
                self._record_error(schedule_id, exc)
                continue
            fired = done.fired
            if fired is not None and fired.task_id is not None:
                self.fired += 1
                log.info("schedule %s fired task %s", schedule_id, fired.task_id)
            after_commit(done.effects)

    def _record_error(self, schedule_id: str, exc: Exception) -> None:
        try:
            with transaction() as session:
                session.execute(
                    update(Schedule)
                    .where(Schedule.id == schedule_id)
                    .values(last_error=f"{type(exc).__name__}: {exc}"[:2000])
                )
        except Exception:
            log.debug("could not record the schedule's error", exc_info=True)

    # --- the thread -----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        waiter = Waiter()
        interval = self.settings.dispatch_interval_seconds
        takeover = min(1.0, self.ttl_ms / 3000)
        try:
            while not stop.is_set():
                try:
                    if not self.lead():
                        stop.wait(takeover)
                        continue
                    if self.broker_full():
                        waiter.wait(interval)
                        continue
                    found = self.round()
                except Exception:
                    log.exception("dispatch failed; trying again")
                    self._renewed = 0.0
                    stop.wait(takeover)
                    continue
                if found.more:
                    continue  # a tenant had more than a round reads, and there is room
                # Otherwise wait: for slots to free up (or due times to come) while work
                # waits, else for a wake-up. Many small rounds would cost more than they win.
                waiter.wait(interval if found.waiting or found.admitted else IDLE_SECONDS)
        finally:
            self.resign()
            waiter.close()


def start() -> threading.Event:
    """Start this process's dispatcher thread; set the returned event to stop it."""
    stop = threading.Event()
    threading.Thread(
        target=Dispatcher().run, args=(stop,), name="ratchet-dispatcher", daemon=True
    ).start()
    return stop
