"""``cancels.call``: a step's wait on a call ends at once when its task is cancelled, or at
its deadline; model and tool calls run on pools of their own, so hung tools never keep a
model call waiting; abandoned calls are counted while they run, and at the limit the process
is told it is wedged."""

from __future__ import annotations

import os
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


@pytest.fixture
def small_pools(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """This process's call pools made small (2 threads a step, 2 abandoned calls at most: 4
    threads each), and the reasons the wedged callback was given."""
    told: list[str] = []
    monkeypatch.setitem(cancels._pools, os.getpid(), cancels.CallPools(2, limit=2))
    monkeypatch.setattr(cancels, "_on_wedged", told.append)
    return told


def test_hung_tool_calls_free_their_callers_and_leave_the_model_pool_alone(
    small_pools: list[str],
) -> None:
    release = threading.Event()
    try:
        for _ in range(6):  # more than the tool pool's 4 threads: its queue backs up too
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                cancels.call(lambda: release.wait(LONG), timeout=0.05, name="tool-hung")
            assert time.monotonic() - started < LONG / 2  # freed at its deadline
        # Every tool thread is held by a hung call; a model call runs on a pool of its own.
        assert cancels.call(lambda: "answer", timeout=LONG, pool=cancels.MODEL) == "answer"
    finally:
        release.set()


def test_abandoned_calls_are_counted_until_they_return_and_the_limit_is_told_once(
    small_pools: list[str],
) -> None:
    release = threading.Event()
    with pytest.raises(TimeoutError):
        cancels.call(lambda: release.wait(LONG), timeout=0.01)
    assert cancels.abandoned() == 1
    assert small_pools == []  # below the limit: the process goes on
    with pytest.raises(TimeoutError):
        cancels.call(lambda: release.wait(LONG), timeout=0.01, pool=cancels.MODEL)
    assert cancels.abandoned() == 2
    assert len(small_pools) == 1
    assert "2 abandoned calls" in small_pools[0]
    with pytest.raises(TimeoutError):
        cancels.call(lambda: release.wait(LONG), timeout=0.01)
    assert len(small_pools) == 1  # told once: the process is on its way out
    release.set()
    deadline = time.monotonic() + LONG
    while cancels.abandoned() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cancels.abandoned() == 0  # the calls returned: none holds a thread any more


def test_a_call_that_answers_in_time_is_never_counted(small_pools: list[str]) -> None:
    for _ in range(5):
        assert cancels.call(lambda: "quick", timeout=LONG) == "quick"
    assert cancels.abandoned() == 0
    assert small_pools == []


def test_a_pause_gives_way_to_a_cancel() -> None:
    with cancels.watching("task-e"):
        threading.Timer(0.05, lambda: cancels.cancel("task-e")).start()
        started = time.monotonic()
        with pytest.raises(cancels.Interrupted):
            cancels.pause(LONG)
    assert time.monotonic() - started < LONG / 2
