"""The webhook sends this process has going in the background, to be waited for before the
database they write to changes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")


class SendPool(ThreadPoolExecutor):
    """The webhook sender's background pool, which keeps the future of each send until it is
    done, so that the sends can be waited for."""

    def __init__(self) -> None:
        super().__init__(max_workers=4, thread_name_prefix="webhook")
        self._sends: set[Future[Any]] = set()
        self._sends_lock = threading.Lock()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future = super().submit(fn, *args, **kwargs)
        with self._sends_lock:
            self._sends.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future[Any]) -> None:
        with self._sends_lock:
            self._sends.discard(future)

    def wait_for_sends(self) -> None:
        with self._sends_lock:
            sends = list(self._sends)
        wait(sends)


def finish_webhook_sends() -> None:
    """Wait for the webhook sends this process has going in the background: each writes its
    outcome to the database configured when it runs, which is about to change."""
    from workers import webhook_sender

    if webhook_sender._pool is None:
        # The sender makes its pool on its first send; made here, it is one to wait on.
        webhook_sender._pool = SendPool()
    pool = webhook_sender._pool
    assert isinstance(pool, SendPool), "the webhook sender made its pool before the tests did"
    pool.wait_for_sends()
