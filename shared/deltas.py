"""The live view of a model call in progress: its deltas, on their way from the worker that
streams the call to every event stream of its task (and of its thread).

They are not part of the durable log: a worker hands them to the transport (a Redis stream per
task in production, process memory under ``ratchet dev``), never to the database one by one,
and the committed ``step.model_response`` is the truth they concatenate to. A lost delta costs
a reader the live view of that call, never the answer.

Each entry of a task's delta log carries the seq of the last event committed when its call
began (``after``) and a position in the log (``pos``, increasing). Its event id,
``"<after>.<pos>"``, orders it with the committed events: after event ``after``, before event
``after + 1``. A reader that sends ``Last-Event-ID: 12.1732752000123000`` is given the deltas
after that one of the call in progress, then the rest; once the call's answer is committed, its
deltas are not sent again (the committed event stands for them). Committed events keep their
integer ids.

The log is fenced by call: each entry names its call (the lease epoch and the attempt within
the lease), an entry of a call older than the log's last is refused (a stalled worker that lost
its lease cannot mix its answer into the new one), and the first entry of a newer call of the
same step, when the log ends in a partial answer, is preceded by a ``message.discarded`` entry:
readers drop what they hold of that step before the new deltas.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger("ratchet.deltas")

MESSAGE_DELTA = "message.delta"
MESSAGE_DISCARDED = "message.discarded"
LIVE_EVENT_TYPES = (MESSAGE_DELTA, MESSAGE_DISCARDED)

# A task's delta log keeps about this many entries (a call's deltas are gathered every few
# tens of ms, so some minutes of one call) and is dropped this long after its last entry.
LOG_MAX_ENTRIES = 10_000
LOG_TTL_SECONDS = 900
READ_BATCH = 500

DiscardReason = Literal["retried", "rerun"]


@dataclass(frozen=True)
class Piece:
    """What a worker appends: one gathered delta of a call, its event data as JSON."""

    task_id: str
    step: int
    epoch: int  # the lease the call ran under
    attempt: int  # the call's attempt within that lease (1, 2, …)
    after: int  # the seq of the last event committed when the call began
    data: str


@dataclass(frozen=True)
class Delta:
    """An entry of a task's delta log, as a reader gets it."""

    pos: int
    kind: Literal["delta", "discarded"]
    step: int
    after: int
    data: str  # the event's data, JSON

    @property
    def event_type(self) -> str:
        return MESSAGE_DELTA if self.kind == "delta" else MESSAGE_DISCARDED

    @property
    def event_id(self) -> str:
        return event_id(self.after, self.pos)


def event_id(after: int, pos: int) -> str:
    return f"{after}.{pos}"


def discarded_data(step: int, reason: str) -> str:
    """A ``message.discarded`` event's data: the step whose partial answer is void, and why
    (``retried``: the call failed and is asked again; ``rerun``: the step runs again under a
    new lease, its worker having died or lost its lease)."""
    return f'{{"step":{step},"reason":"{reason}"}}'


def parse_event_id(text: str) -> tuple[int, int]:
    """``(seq, pos)`` from an event id: ``"12"`` (a committed event: pos 0) or ``"12.345"``
    (a delta). A ValueError for anything else."""
    seq, dot, pos = text.partition(".")
    if not _digits(seq) or (dot and not _digits(pos)):
        raise ValueError(f"not an event id: {text!r}")
    return int(seq), int(pos) if dot else 0


def _digits(value: str) -> bool:
    return value.isascii() and value.isdigit()


@dataclass
class Cursor:
    """Where a reader of a task's stream stands: the last committed event it sent (``seq``)
    and how far it has read the delta log (``pos``).

    Only the deltas of the call in progress are sent: an entry whose call began after ``seq``
    (``after == seq``). One whose call began before it was answered by an event already sent;
    one whose call began after a commit the reader has not sent yet waits for that commit to be
    read and sent first. Once the call's answer is committed, the rest of its deltas go only to
    a reader that holds part of it (``open``: it sent some, or resumed from one); to the others
    the committed event stands for them."""

    seq: int
    pos: int = 0
    open: bool = False  # the reader holds part of the call in progress

    @classmethod
    def resuming(cls, seq: int, pos: int) -> Cursor:
        """From a ``Last-Event-ID`` (``parse_event_id``): mid-call if it named a delta."""
        return cls(seq, pos, open=pos > 0)

    def take(self, deltas: list[Delta]) -> tuple[list[Delta], list[Delta]]:
        """Of ``deltas`` (read after ``pos``, in order): those to send now, and the rest, which
        follow a commit not sent yet (send it, then take them again).

        A reader that reads committed events must read the delta log after them and take
        from it before sending each one: a call's last deltas are in the log before its
        answer is committed, and once the answer is sent they are passed over."""
        send: list[Delta] = []
        for index, delta in enumerate(deltas):
            if delta.after > self.seq:
                return send, deltas[index:]
            if delta.after == self.seq:
                send.append(delta)
            self.pos = delta.pos
        self.open = self.open or bool(send)
        return send, []

    def before_commit(self, deltas: list[Delta]) -> tuple[list[Delta], list[Delta]]:
        """As :meth:`take`, just before the committed event that follows the call in
        progress: its last deltas for a reader that holds part of it, none for the others."""
        if self.open:
            return self.take(deltas)
        _, rest = self.take(deltas)
        self.open = False
        return [], rest

    def committed(self, seq: int) -> None:
        """The reader sent the committed event ``seq``."""
        self.seq, self.open = seq, False


def read_deltas(task_id: str, cursor: Cursor, *, limit: int = READ_BATCH) -> list[Delta]:
    """The entries of ``task_id``'s delta log after ``cursor.pos``, oldest first, at most
    ``limit`` (pass them to ``cursor.take``). May raise ``TransportUnavailable``."""
    from shared.transport import get_transport  # the transport imports this module's types

    return get_transport().read_deltas(task_id, after=cursor.pos, limit=limit)


async def aread_live(task_id: str, cursor: Cursor) -> tuple[list[Delta], bool]:
    """The delta log after the cursor, read on the running event loop, and whether more may
    be waiting. Nothing when the transport does not answer: a reader loses the live view for
    a while, never the committed events."""
    from shared.transport import TransportUnavailable, get_transport

    try:
        read = await get_transport().aread_deltas(task_id, after=cursor.pos, limit=READ_BATCH)
    except TransportUnavailable:
        log.debug("live deltas unavailable for task %s", task_id, exc_info=True)
        return [], False
    return read, len(read) == READ_BATCH
