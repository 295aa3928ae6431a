"""The direct path: a task submitted while nothing waits ahead of it skips the backlog.

Admission through the dispatcher costs a task an UPDATE and a wait for the next round. When
the fleet has room and no task waits, a round would admit a new task at once anyway, so the
submission admits it itself: its INSERT sets ``admitted_ms`` and the API sends its message
once committed (lost, the sweeper sends it, as for any admitted task). Admitted, it holds
its slots like any other: the dispatcher's next round counts it.

The gate is a number of slots. The dispatcher opens it after a round that left no due task
waiting for room, with the budget that round left unspent (the fleet's free slots, within
the broker's window), for ``GATE_SECONDS``; each submission that goes direct takes one.
A round that leaves a due task waiting for room closes it, and so does a leader giving up.
So a task goes direct only when the dispatcher would have admitted it at once, and never
ahead of one waiting in the backlog: fairness, priority and capacity hold as through the
backlog. Tasks under a concurrency limit, and tasks not due yet, always go through the
backlog (the API counts no slots). A tenant's default share of the fleet is kept by the
gate's size instead: a round opens it with no more slots than the busiest tenant under that
share may still take, so whoever takes them, no tenant goes past its share (and while one is
at its share, everything goes through the backlog).

Taking a slot is one Redis script on the broker, or process memory under ``ratchet dev`` (the
transport's: ``shared.transport``); no answer is a no. A process that was told no asks again
only ``CLOSED_RECHECK_SECONDS`` later: under load the gate is mostly closed (work waits for
room), and asking on every submission cost the API a fifth of its CPU per submission, where
an idle fleet's submissions come far enough apart to each ask. On by default
(``RATCHET_DIRECT_ADMISSION``): on an idle fleet a task reaches its model in about half the
time (``ratchet bench latency``); the API then sends those tasks' messages itself, one at a
time, where a round sends many in one pipeline.
"""

from __future__ import annotations

import time

from shared.constants import DISPATCH_GATE_PREFIX
from shared.settings import get_settings
from shared.transport import get_transport

GATE_SECONDS = 1.0  # an open gate closes by itself this long after the round that opened it
CLOSED_RECHECK_SECONDS = 0.05  # a process told "no" asks again this long after

_closed_until = 0.0  # this process was told no: it goes through the backlog until then


def _key() -> str:
    return DISPATCH_GATE_PREFIX + get_settings().queue_name


class Gatekeeper:
    """The dispatcher's side of the gate: closed while a round counts and admits, then opened
    with the slots the round left spare.

    A round counts what is admitted from the database, but a submission takes its slot before
    its INSERT commits: a round that read in between would see the slot as free and offer it
    again (through the gate, or to a task in the backlog), so that a flood of one tenant's
    submissions could take the fleet past its default share. So a submission lands its slot
    once its INSERT has committed (or failed), and a round begins by closing the gate and
    reading, in the same step, how many slots are taken and not landed
    (``Transport.reset_gate``): read before the round's own reads, that count holds every
    direct task the round cannot see (one that commits in between is counted twice, and the
    round admits one less), and the round holds so many back, from the fleet's room and
    from every tenant's share."""

    def __init__(self) -> None:
        self._open = False  # whether the gate was opened after the last round
        self._flying = 0  # slots taken and not landed, when last read

    def close(self) -> int:
        """Close the gate (a round begins, or the lead is given up); returns the slots taken
        from it and not landed, which a round holds back."""
        if not get_settings().direct_admission:
            return 0
        if self._open or self._flying:  # else closed since a round that found none flying
            self._flying = get_transport().reset_gate(_key(), 0, ttl_seconds=GATE_SECONDS)
            self._open = False
        return self._flying

    def open(self, slots: int) -> None:
        """A round left nothing due waiting, and ``slots`` to spare (the slots in flight held
        back already): let so many in directly."""
        global _closed_until  # noqa: PLW0603 - one answer remembered per process
        if not get_settings().direct_admission or slots <= 0:
            return
        get_transport().reset_gate(_key(), slots, ttl_seconds=GATE_SECONDS)
        self._open = True
        _closed_until = 0.0  # this process opened it: its submissions need not wait to ask


def take_slot() -> bool:
    """Whether a submission due now may be admitted directly: takes one of the gate's slots,
    which the caller lands (:func:`land_slot`) once its INSERT has committed or failed. Never
    raises."""
    global _closed_until  # noqa: PLW0603
    if not get_settings().direct_admission:
        return False
    now = time.monotonic()
    if now < _closed_until:
        return False
    taken = get_transport().take_gate_slot(_key())
    if not taken:
        _closed_until = now + CLOSED_RECHECK_SECONDS
    return taken


def land_slot() -> None:
    """A slot taken by :func:`take_slot` has landed: its task's INSERT committed (the rounds
    now count it) or failed. Never raises."""
    get_transport().land_gate_slot(_key())
