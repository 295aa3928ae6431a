"""What a transport does: the fleet's traffic outside the database and the broker's messages.

Every wake-up here only says "look again": Postgres stays the truth, so a lost one costs its
reader a fallback poll, never work. None of the senders raises; the readers of the live view
raise :class:`TransportUnavailable` when they cannot answer.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from shared.deltas import Delta, Piece
from shared.errors import RatchetError
from shared.ratelimit.buckets import Limiter
from shared.settings import Settings

Listener = Callable[[str], None]
# A slot taken from the gate and never landed (its process died between) counts as in flight
# until no slot has been taken for this long.
GATE_LANDING_SECONDS = 5.0


class TransportUnavailable(RatchetError):
    """The transport does not answer (Redis is down or out of reach)."""


class Waiter(Protocol):
    """What the dispatcher waits on between rounds: a wake-up, or the timeout."""

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a wake-up; whether one came. Never raises."""
        ...

    def close(self) -> None: ...


class Following(Protocol):
    """A subscription to the event wake-ups, held by an API process's event hub."""

    async def stop(self) -> None: ...


class Presence(Protocol):
    """The fleet's live view of one queue name: a record per member that expires on its own,
    and the sweeper's last run. Records are opaque text here; ``shared.ops.fleet`` reads them.
    Every method may raise :class:`TransportUnavailable`."""

    def put(self, member: str, record: str, *, seen_at: float, ttl_seconds: float) -> None: ...

    def remove(self, member: str) -> None: ...

    def records(self, limit: int) -> list[str | bytes]:
        """The live members' records, the most recently put first, at most ``limit``."""
        ...

    def put_sweep(self, record: str) -> None: ...

    def sweep(self) -> str | bytes | None: ...


class Transport(ABC):
    """Redis (``RedisTransport``) or process memory (``LocalTransport``), chosen once by
    ``shared.transport.get_transport``. Callers never ask which one they hold."""

    name: str

    # --- the broker -----------------------------------------------------------------------

    @abstractmethod
    def broker_options(self, settings: Settings) -> dict[str, float]:
        """Celery's ``broker_transport_options`` for this kind of broker."""

    @abstractmethod
    def queue_depth(self, queue: str) -> int | None:
        """How many messages wait in ``queue``; None when the broker cannot be looked into.
        May raise :class:`TransportUnavailable`."""

    @abstractmethod
    def oldest_message(self, queue: str) -> bytes | None:
        """The next message ``queue`` will hand out, raw; None when none waits or the broker
        cannot be looked into. May raise :class:`TransportUnavailable`."""

    # --- wake-ups ---------------------------------------------------------------------------

    @abstractmethod
    def wake_readers(self, task_ids: Iterable[str]) -> None:
        """Tell the event readers of these tasks (streams, long polls) to look again."""

    @abstractmethod
    def wake_dispatcher(self, queue_name: str) -> None:
        """Tell the dispatcher of ``queue_name`` to look now."""

    @abstractmethod
    def dispatcher_waiter(self, queue_name: str) -> Waiter:
        """What the dispatcher of ``queue_name`` waits on between its rounds."""

    @abstractmethod
    def wake_cancel(self, task_id: str) -> None:
        """Tell the process running ``task_id`` that a cancel was requested. A lost one is
        found by the heartbeat, which sees the task's flag."""

    @abstractmethod
    def follow_readers(
        self,
        wake: Listener,
        *,
        wake_all: Callable[[], None],
        log: logging.Logger,
        wake_deltas: Listener | None = None,
    ) -> Following:
        """Call ``wake(task_id)`` on the running event loop for each event wake-up,
        ``wake_deltas(task_id)`` for each wake-up that only says new deltas came, and
        ``wake_all()`` whenever some may have been missed (an outage, a resubscription),
        until the returned subscription stops. Outages are logged on ``log``."""

    @abstractmethod
    def follow_cancels(self, cancel: Listener, *, log: logging.Logger) -> None:
        """Call ``cancel(task_id)`` for each cancel wake-up, for as long as the process lives
        (call it once a process). Outages are logged on ``log``."""

    # --- the live deltas of model calls (``shared.deltas``) ----------------------------------

    @abstractmethod
    def append_deltas(self, pieces: Sequence[Piece]) -> bool:
        """Append each piece to its task's delta log (fenced by call, a discard entry before a
        newer call's first piece where the log ends in a partial answer of the same step; see
        ``shared.deltas``), and wake those tasks' readers; whether they went out. Never
        raises: a lost piece costs the readers the live view of its call, never the answer."""

    @abstractmethod
    def read_deltas(self, task_id: str, *, after: int, limit: int) -> list[Delta]:
        """The entries of ``task_id``'s delta log after position ``after``, oldest first.
        May raise :class:`TransportUnavailable`."""

    async def aread_deltas(self, task_id: str, *, after: int, limit: int) -> list[Delta]:
        """:meth:`read_deltas` on the running event loop (an API process's streams read
        each batch of deltas of each call they follow: a thread each time would cost more
        than the read). As :meth:`read_deltas` where the log is process memory."""
        return self.read_deltas(task_id, after=after, limit=limit)

    # --- the live view, the gate, the limiter, readiness -----------------------------------

    @abstractmethod
    def presence(self, name: str) -> Presence:
        """The live view of the fleet that takes from the queue ``name``."""

    @abstractmethod
    def reset_gate(self, key: str, slots: int, *, ttl_seconds: float) -> int:
        """Let ``slots`` submissions take a slot of the gate ``key`` (0 closes it) until it
        closes by itself, ``ttl_seconds`` from now; returns how many slots taken from it have
        not landed yet (:meth:`land_gate_slot`). Never raises: no answer is 0 (with no
        answer, no slot is taken either)."""

    @abstractmethod
    def take_gate_slot(self, key: str) -> bool:
        """Take one of the gate's slots, if it has one left; no answer is a no. A slot taken
        is in flight until :meth:`land_gate_slot` (or, for a process that died first, until
        ``GATE_LANDING_SECONDS`` pass with no slot taken)."""

    @abstractmethod
    def land_gate_slot(self, key: str) -> None:
        """A slot taken from the gate ``key`` has landed: its task's INSERT committed, or
        failed. Never raises."""

    @abstractmethod
    def limiter(self) -> Limiter:
        """The rate limiter every process of the fleet shares (one per transport)."""

    @abstractmethod
    def readiness(self) -> dict[str, str]:
        """The services this transport needs, each ``"ok"`` or ``"error: <kind>"``."""
