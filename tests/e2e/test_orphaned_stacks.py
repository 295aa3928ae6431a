"""A test runner that was cut off leaves its stacks running; the next run's first stack stops
them, and no process of a runner still alive."""

from __future__ import annotations

import os
import subprocess
import time

from tests.e2e.conftest import RUNNER, stop_orphaned_stacks


def started(runner: int) -> subprocess.Popen[bytes]:
    """A process in a session of its own, as a stack's are, started for ``runner``."""
    return subprocess.Popen(
        ["sleep", "600"], env={**os.environ, RUNNER: str(runner)}, start_new_session=True
    )


def gone_runner() -> int:
    """The pid of a process that has exited (and been reaped)."""
    finished = subprocess.Popen(["true"])
    finished.wait()
    return finished.pid


def test_the_stacks_of_a_runner_that_is_gone_are_stopped_and_no_others() -> None:
    orphan, ours = started(gone_runner()), started(os.getpid())
    try:
        stop_orphaned_stacks()
        assert orphan.wait(timeout=30) == -9
        time.sleep(0.2)
        assert ours.poll() is None
    finally:
        for proc in (orphan, ours):
            proc.kill()
            proc.wait()
