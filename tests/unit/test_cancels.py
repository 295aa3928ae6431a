"""``cancels.call``: a step's wait on a call ends at once when its task is cancelled."""

from __future__ import annotations

import threading
import time

import pytest

from workers import cancels

LONG = 60.0  # what a call would take had the cancel not cut it short


def test_a_call_returns_its_result_and_raises_its_error() -> None:
    assert cancels.call(lambda: 42, timeout=LONG) == 42
    with pytest.raises(ZeroDivisionError):
        cancels.call(lambda: 1 / 0, timeout=LONG)


def test_a_call_past_its_timeout_is_abandoned() -> None:
    release = threading.Event()
    with pytest.raises(TimeoutError):
        cancels.call(lambda: release.wait(LONG), timeout=0.05)
    release.set()


def test_a_cancel_of_the_running_step_interrupts_its_call() -> None:
    release, entered = threading.Event(), threading.Event()

    def slow() -> str:
        entered.set()
        release.wait(LONG)
        return "late"

    with cancels.watching("task-a"):
        threading.Timer(0.0, lambda: entered.wait(LONG) and cancels.cancel("task-a")).start()
        started = time.monotonic()
        with pytest.raises(cancels.Interrupted):
            cancels.call(slow)
        waited = time.monotonic() - started
    release.set()
    assert waited < LONG / 2  # it did not wait for the call


def test_a_cancel_of_another_task_leaves_the_call_alone() -> None:
    with cancels.watching("task-b"):
        cancels.cancel("task-c")
        assert cancels.call(lambda: "mine", timeout=LONG) == "mine"


def test_a_cancel_before_the_call_interrupts_it_at_once() -> None:
    release = threading.Event()
    with cancels.watching("task-d") as watch:
        cancels.cancel("task-d")
        assert watch.cancelled.is_set()
        with pytest.raises(cancels.Interrupted):
            cancels.call(lambda: release.wait(LONG), timeout=LONG)
    release.set()
