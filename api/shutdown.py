"""Ending open SSE streams when the API process is told to stop.

uvicorn stops on SIGTERM (or SIGINT) by waiting for every request in progress to end, and an
SSE stream of a task that does not finish never ends by itself. So the stop is also heard
here: :func:`on_exit_signal` runs a callback on the event loop as the signal arrives (the event
hub's :meth:`~api.event_hub.EventHub.close`, which ends each stream with a last event), before
uvicorn's own handler; ``api_shutdown_grace_seconds`` bounds whatever else still runs.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from types import FrameType

EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def on_exit_signal(callback: Callable[[], None]) -> Callable[[], None]:
    """Call ``callback`` on the running loop whenever an exit signal arrives, then the handler
    that was there before; return a function that puts the previous handlers back.

    Only a Python handler is chained (the server's): with none, or off the main thread (where
    no signal handler may be set, e.g. an app in a test client), nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in EXIT_SIGNALS}

    def handle(sig: int, frame: FrameType | None) -> None:
        # A signal handler runs between two bytecodes of the loop's own thread: hand the
        # callback to the loop rather than run it in the middle of whatever was running.
        loop.call_soon_threadsafe(callback)
        before = previous[signal.Signals(sig)]
        if callable(before):
            before(sig, frame)

    installed = [sig for sig, before in previous.items() if callable(before)]
    for sig in installed:
        signal.signal(sig, handle)

    def restore() -> None:
        for sig in installed:
            if signal.getsignal(sig) is handle:
                signal.signal(sig, previous[sig])

    return restore
