"""Durable waits, as a tool asks for one: raise :class:`Wait` and the task parks until the
outside world answers (``POST /v1/waits/{token}``) or the deadline passes.

A tool that raises ``Wait`` has done its part (sent the email with the link, opened the CI
run): the call's outcome is what completes the wait, committed once, and the tool is not
run again for it. The worker holds nothing while the task waits: no thread, lease or slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

WaitTimeoutPolicy = Literal["fail_call", "tell_model", "fail_task"]
WAIT_TIMEOUT_POLICIES: tuple[str, ...] = ("fail_call", "tell_model", "fail_task")


class Wait(Exception):
    """Raised by a tool to park its call on the outside world.

    ``request``: what the wait is for (JSON; shown to whoever completes it, e.g. a question).
    ``timeout_seconds``: how long it may last (default ``RATCHET_WAIT_TIMEOUT_SECONDS``).
    ``on_timeout``: at the deadline, ``fail_call`` (the model reads that it timed out, as
    an error), ``tell_model`` (the call succeeds with ``{"timed_out": true}``) or
    ``fail_task`` (default ``RATCHET_WAIT_ON_TIMEOUT``). The completion's JSON body becomes
    the call's result.
    """

    def __init__(
        self,
        request: Any = None,
        *,
        timeout_seconds: float | None = None,
        on_timeout: WaitTimeoutPolicy | None = None,
    ) -> None:
        if on_timeout is not None and on_timeout not in WAIT_TIMEOUT_POLICIES:
            raise ValueError(f"on_timeout must be one of {', '.join(WAIT_TIMEOUT_POLICIES)}")
        if timeout_seconds is not None and not 0 < timeout_seconds <= 30 * 86_400:
            raise ValueError("timeout_seconds must be more than 0 and at most 30 days")
        super().__init__("the tool asked to wait for the outside world")
        self.request = request
        self.timeout_seconds = timeout_seconds
        self.on_timeout = on_timeout


@dataclass(frozen=True)
class Parking:
    """How a call parks: on a token the outside world completes (``child_id`` None), or on
    the child task a sub-agent call started."""

    request: Any = None
    timeout_seconds: float | None = None
    on_timeout: str | None = None
    child_id: str | None = None

    @property
    def kind(self) -> str:
        return "token" if self.child_id is None else "child"

    @classmethod
    def of(cls, wait: Wait) -> Parking:
        return cls(wait.request, wait.timeout_seconds, wait.on_timeout)
