"""A streaming model call's deltas on their way to its task's live readers (``shared.deltas``).

The provider hands each piece of the answer to the call's :class:`CallDeltas` as it comes; one
thread of the process (:class:`Gatherer`) takes what every call in flight has gathered each
``GATHER_SECONDS`` and hands it all to the transport at once (one Redis pipeline), so a fast
stream costs a message every few tens of ms, not one per token, and hundreds of streams cost one
pipeline. The step never waits on the transport but at the call's end, when the rest of its
deltas go out before its answer is committed (so they come before the committed event), and
then for at most ``FINISH_WAIT_SECONDS``, and not at all while the transport is failing (the
last hand-over did not go out): a lost batch costs the readers the live view only.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from shared.deltas import Piece
from shared.transport import get_transport

log = logging.getLogger("ratchet.deltas")

GATHER_SECONDS = 0.04
FINISH_WAIT_SECONDS = 2.0  # as long as a Redis command may take (shared.transport.redis)


class CallDeltas:
    """One attempt of one model call: what it streamed since the gatherer last took it, and
    how to stop it (``workers.providers.base.Deltas``). Once finished it takes nothing more:
    an abandoned call that streams on is not heard."""

    def __init__(
        self, gatherer: Gatherer, *, task_id: str, step: int, epoch: int, attempt: int, after: int
    ) -> None:
        self._gatherer = gatherer
        self.task_id, self.step, self.epoch, self.attempt, self.after = (
            task_id,
            step,
            epoch,
            attempt,
            after,
        )
        self._lock = threading.Lock()
        self._text: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._sent = 0  # deltas handed over so far
        self._stop_lock = threading.Lock()
        self._stops: list[Callable[[], None]] = []
        self._stopped = False
        self._finished = False
        self._pending = False  # handed to the gatherer since its last take

    def text(self, delta: str) -> None:
        with self._lock:
            if self._finished:
                return
            self._text.append(delta)
            told, self._pending = self._pending, True
        if not told:
            self._gatherer.pending(self)

    def tool_call(self, index: int, *, call_id: str, name: str, arguments: str) -> None:
        with self._lock:
            if self._finished:
                return
            call = self._calls.get(index)
            if call is None:
                call = self._calls[index] = {"index": index, "arguments": ""}
            if call_id:
                call["id"] = call_id
            if name:
                call["name"] = name
            call["arguments"] += arguments
            told, self._pending = self._pending, True
        if not told:
            self._gatherer.pending(self)

    @contextmanager
    def stopping(self, stop: Callable[[], None]) -> Iterator[None]:
        # Stops run under the stop lock, so none runs once the block is left.
        with self._stop_lock:
            self._stops.append(stop)
            if self._stopped:
                _safely(stop)
        try:
            yield
        finally:
            with self._stop_lock:
                self._stops.remove(stop)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def stop(self) -> None:
        """End the call's stream at once (its provider's HTTP response is shut)."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            for stop in self._stops:
                _safely(stop)

    def take(self) -> Piece | None:
        """What was gathered since the last take, as one delta (None: nothing)."""
        with self._lock:
            self._pending = False
            if not self._text and not self._calls:
                return None
            self._sent += 1
            data: dict[str, Any] = {"step": self.step, "index": self._sent}
            if self._text:
                data["text"] = "".join(self._text)
            if self._calls:
                data["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
            self._text, self._calls = [], {}
        return Piece(
            self.task_id,
            self.step,
            self.epoch,
            self.attempt,
            self.after,
            json.dumps(data, separators=(",", ":"), ensure_ascii=False),
        )

    def finish(self) -> None:
        """The call is over: hand over the rest of its deltas now, and wait (a little) until
        they are out; stop its stream if it still runs (an abandoned call)."""
        with self._lock:
            self._finished = True
        self.stop()
        self._gatherer.flush(self)


def _safely(stop: Callable[[], None]) -> None:
    try:
        stop()
    except Exception:  # a stop that fails leaves the call's deadline to end it
        log.debug("a model call's stream did not stop", exc_info=True)


@dataclass
class Live:
    """The live view of one step's model call under one lease: each attempt streams into a
    :class:`CallDeltas` of its own (numbered, so a retry's first delta discards the failed
    attempt's partial answer)."""

    task_id: str
    step: int
    epoch: int
    after: int  # the seq of the last event committed before the call
    attempts: int = field(default=0)

    def attempt(self) -> CallDeltas:
        self.attempts += 1
        return CallDeltas(
            gatherer(),
            task_id=self.task_id,
            step=self.step,
            epoch=self.epoch,
            attempt=self.attempts,
            after=self.after,
        )


class Gatherer:
    """The process's one thread that hands every call's gathered deltas to the transport,
    ``GATHER_SECONDS`` apart at most as often (at once for a call that finished)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: set[CallDeltas] = set()
        self._urgent = False
        self._started = 0  # hand-overs started, and finished
        self._done = 0
        self._last = 0.0  # when the last hand-over started (monotonic)
        self._failing = False  # the last hand-over did not go out
        threading.Thread(target=self._run, name="ratchet-deltas", daemon=True).start()

    def pending(self, call: CallDeltas) -> None:
        with self._cond:
            if not self._pending:
                self._cond.notify()
            self._pending.add(call)

    def flush(self, call: CallDeltas) -> None:
        """Hand ``call``'s deltas over in the next hand-over, started at once, and wait for it
        (``FINISH_WAIT_SECONDS`` at most)."""
        deadline = time.monotonic() + FINISH_WAIT_SECONDS
        with self._cond:
            self._pending.add(call)
            self._urgent = True
            target = self._started + 1
            self._cond.notify_all()
            while (
                not self._failing
                and self._done < target
                and (left := deadline - time.monotonic()) > 0
            ):
                self._cond.wait(left)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                while (
                    not self._urgent
                    and (left := self._last + GATHER_SECONDS - time.monotonic()) > 0
                ):
                    self._cond.wait(left)  # let more gather, unless a call finished
                calls, self._pending, self._urgent = self._pending, set(), False
                self._started += 1
                number, self._last = self._started, time.monotonic()
            pieces = [piece for call in calls if (piece := call.take()) is not None]
            delivered = True
            try:
                if pieces:
                    delivered = get_transport().append_deltas(pieces)
            except Exception:  # never the step's concern: its answer is committed anyway
                log.warning("live deltas not handed over", exc_info=True)
                delivered = False
            with self._cond:
                self._failing = not delivered
                self._done = number
                self._cond.notify_all()


_gatherers: dict[int, Gatherer] = {}  # by process: threads do not survive a fork
_lock = threading.Lock()


def gatherer() -> Gatherer:
    pid = os.getpid()
    found = _gatherers.get(pid)
    if found is None:
        with _lock:
            found = _gatherers.get(pid) or _gatherers.setdefault(pid, Gatherer())
    return found
