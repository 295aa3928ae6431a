"""The step pool: a hand-off waits for a free thread, a failing step frees its thread, and a
drain waits for the steps in flight."""

from __future__ import annotations

import threading

from workers.step_pool import StepPool

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
