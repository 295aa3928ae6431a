"""The step pool: a hand-off waits for a free thread, a failing step frees its thread, a
drain waits for the steps in flight, and steps run their own code in turns (first come,
first served) that a step waiting on a call gives up."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from workers import cancels, step_pool
from workers.step_pool import StepPool, Turns

WAIT = 30.0  # a bound for the test to fail rather than hang; never reached when it passes


def test_a_full_pool_makes_the_next_hand_off_wait_for_a_free_thread() -> None:
    pool, release = StepPool(2), threading.Event()
    started = threading.Semaphore(0)

    def step() -> None:
        started.release()
        release.wait(WAIT)

    pool.run(step)
    pool.run(step)
    assert started.acquire(timeout=WAIT)
    assert started.acquire(timeout=WAIT)
    handed = threading.Event()
    third = threading.Thread(target=lambda: (pool.run(step), handed.set()))
    third.start()

    assert not handed.wait(0.3)  # both threads are busy: the third waits …
    assert pool.busy == 2
    release.set()
    assert handed.wait(WAIT)  # … until one is free
    third.join(WAIT)
    assert pool.drain(WAIT) == 0


def test_a_step_that_raises_frees_its_thread() -> None:
    pool, ran = StepPool(1), threading.Event()

    def broken() -> None:
        raise RuntimeError("a bug in a step")

    pool.run(broken)
    pool.run(ran.set)  # would wait forever had the broken step kept the only thread

    assert ran.wait(WAIT)
    assert pool.drain(WAIT) == 0


def test_drain_waits_for_the_steps_in_flight_and_says_how_many_are_left() -> None:
    pool, release, done = StepPool(4), threading.Event(), []

    def step() -> None:
        release.wait(WAIT)
        done.append(1)

    for _ in range(3):
        pool.run(step)

    assert pool.drain(0.05) == 3  # none could finish: all three are still running
    release.set()
    assert pool.drain(WAIT) == 0
    assert len(done) == 3


def test_the_threads_start_with_the_pool_not_with_its_first_hand_offs() -> None:
    before = {t.ident for t in threading.enumerate()}
    pool = StepPool(5)
    assert pool._threads.started.wait(WAIT)  # started by a thread of their own, at once
    started = [
        t for t in threading.enumerate() if t.ident not in before and t.name.startswith("step-")
    ]
    assert len(started) == 5  # a hand-off never waits for a thread to be started
    ran = threading.Event()
    pool.run(ran.set)
    assert ran.wait(WAIT)
    now = {t.ident for t in threading.enumerate() if t.name.startswith("step-")}
    assert now - before == {t.ident for t in started}  # the hand-off started none
    assert pool.drain(WAIT) == 0


def test_a_hand_off_that_may_not_wait_is_refused_by_a_full_pool() -> None:
    pool, release = StepPool(1), threading.Event()
    assert pool.run(lambda: release.wait(WAIT))
    assert not pool.run(lambda: None, wait=False)  # its only thread is busy: refused at once
    release.set()
    assert pool.drain(WAIT) == 0
    ran = threading.Event()
    assert pool.run(ran.set, wait=False)
    assert ran.wait(WAIT)


def test_steps_run_in_turns_and_a_step_waiting_on_a_call_gives_its_turn_up() -> None:
    """Two turns for six steps: never more than two run their own code at once (and two do:
    the first two wait for each other in their turns), yet all six wait on their calls
    together (a waiting step holds no turn)."""
    pool, lock = StepPool(8, turns=2), threading.Lock()
    running, most, done = [0], [0], []
    pair, all_waiting = threading.Event(), threading.Barrier(6, timeout=WAIT)

    def in_turn() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            if running[0] == 2:
                pair.set()
        assert pair.wait(WAIT)  # the first two hold both turns at once
        time.sleep(0.005)  # its own work, in its turn
        with lock:
            running[0] -= 1

    def work() -> None:
        in_turn()
        cancels.call(all_waiting.wait, timeout=WAIT)  # would break the barrier if turns held
        in_turn()
        done.append(1)

    for _ in range(6):
        pool.run(work)

    assert pool.drain(WAIT) == 0
    assert len(done) == 6  # every step got past the barrier: all six waited at once
    assert most[0] == 2


def test_a_step_s_helper_threads_run_in_turns_of_its_pool() -> None:
    """One turn: a step waiting for two threads that run parts of it (its tool calls at
    once) gives its turn up; each helper runs its own code in a turn of the same pool, one at
    a time, and gives it up while it waits on a call, so both wait at once."""
    pool, lock = StepPool(2, turns=1), threading.Lock()
    running, most, held, done = [0], [0], [], []
    both_waiting = threading.Barrier(2, timeout=WAIT)

    def in_turn() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.005)
        with lock:
            running[0] -= 1

    def helper(turns: Turns | None) -> None:
        with step_pool.turn_of(turns):
            in_turn()
            cancels.call(both_waiting.wait, timeout=WAIT)  # would break were turns held
            in_turn()
            done.append(1)

    def work() -> None:
        turns = step_pool.held()
        held.append(turns is pool.turns)
        helpers = [threading.Thread(target=helper, args=(turns,)) for _ in range(2)]
        with step_pool.waiting():
            for thread in helpers:
                thread.start()
            for thread in helpers:
                thread.join(WAIT)

    pool.run(work)

    assert pool.drain(WAIT) == 0
    assert held == [True]
    assert len(done) == 2
    assert most[0] == 1


def test_turns_are_handed_out_in_the_order_they_were_asked_for() -> None:
    turns, order = Turns(1), []
    turns.take()
    threads = []
    for number in range(5):

        def wait_for_turn(number: int = number) -> None:
            turns.take()
            order.append(number)
            turns.give()

        thread = threading.Thread(target=wait_for_turn)
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + WAIT
        while len(turns._waiting) < number + 1 and time.monotonic() < deadline:
            time.sleep(0.001)  # this one is in the queue before the next one asks
    turns.give()
    for thread in threads:
        thread.join(WAIT)

    assert order == [0, 1, 2, 3, 4]


def _order_around_a_call(call: Callable[[], object]) -> list[str]:
    """One turn, two steps: the first makes ``call`` while the second waits for the turn."""
    pool, order, queued = StepPool(2, turns=1), [], threading.Event()

    def first() -> None:
        order.append("first starts")
        assert queued.wait(WAIT)
        cancels.call(call, timeout=WAIT)
        order.append("first goes on")

    pool.run(first)
    pool.run(lambda: order.append("second runs"))
    deadline = time.monotonic() + WAIT
    while not pool.turns._waiting and time.monotonic() < deadline:
        time.sleep(0.001)
    queued.set()  # the second step is in line for the turn
    assert pool.drain(WAIT) == 0
    return order


def test_a_call_that_answers_at_once_keeps_its_step_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    # "At once" is within QUICK_SECONDS (2 ms); a busy machine may take longer to run the
    # call's thread, so here the window is as long as the test's bound.
    monkeypatch.setattr(cancels, "QUICK_SECONDS", WAIT)
    assert _order_around_a_call(lambda: 42) == ["first starts", "first goes on", "second runs"]


def test_a_slow_call_gives_the_turn_to_the_step_in_line() -> None:
    order = _order_around_a_call(lambda: time.sleep(0.2))
    assert order == ["first starts", "second runs", "first goes on"]
