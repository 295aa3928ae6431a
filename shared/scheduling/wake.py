"""Waking the dispatcher after a commit that left it work, through the transport: a Redis
PUBLISH in production, an event in the same process under ``ratchet dev``. A lost wake-up
costs the work one poll interval of the dispatcher (it looks again on its own), nothing more."""

from __future__ import annotations

from shared.constants import DISPATCH_CHANNEL_PREFIX
from shared.settings import get_settings
from shared.transport import get_transport
from shared.transport.base import Waiter as TransportWaiter


def channel(queue_name: str | None = None) -> str:
    """The channel the dispatcher of ``queue_name`` (this process's queue) listens on."""
    return DISPATCH_CHANNEL_PREFIX + (queue_name or get_settings().queue_name)


def wake() -> None:
    """Tell the dispatcher to look now: the PUBLISH goes out from the process's wake-up thread,
    so a submission does not wait a round trip to Redis for it, and the wake-ups of many
    submissions at once go out as one. Never raises."""
    get_transport().wake_dispatcher(get_settings().queue_name)


class Waiter:
    """What the dispatcher waits on between rounds: a wake-up, or the timeout."""

    def __init__(self) -> None:
        self._waiter: TransportWaiter = get_transport().dispatcher_waiter(get_settings().queue_name)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a wake-up; whether one came."""
        return self._waiter.wait(timeout)

    def close(self) -> None:
        self._waiter.close()
