"""Wake-ups sent after a commit: to the readers of a task's event log, and to the step of a
task whose cancel was requested.

Postgres stays the source of truth: a wake-up only says "look again", so a lost one costs a
reader its fallback poll interval (a step, its next heartbeat), nothing more. How it travels
is the transport's (``shared.transport``): a Redis PUBLISH from the process's wake-up thread
in production, a call to listeners in the same process in the embedded default.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.constants import EVENTS_CHANNEL_PREFIX
from shared.transport import get_transport


def channel(task_id: str) -> str:
    """The channel that carries ``task_id``'s event wake-ups."""
    return EVENTS_CHANNEL_PREFIX + task_id


def publish(task_ids: Iterable[str]) -> None:
    """Tell readers these tasks have new events (sent in the background). Never raises."""
    get_transport().wake_readers(task_ids)


def publish_cancel(task_id: str) -> None:
    """Tell the worker running ``task_id`` that a cancel was requested, so that its step stops
    waiting. Never raises: a lost wake-up leaves it to the heartbeat, which sees the flag."""
    get_transport().wake_cancel(task_id)
