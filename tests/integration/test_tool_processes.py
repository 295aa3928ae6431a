"""Isolated tool calls through real tool processes (``workers.tool_processes``), started by
this process as a worker process starts them: killed at their limits, replaced after a crash,
reused otherwise. The tools are those of ``tests.sample_agents`` (``isolation="process"``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.agents.registry import ToolContext, get_registry, tool
from tests.conftest import Configure
from tests.helpers import bounded
from workers import cancels, tool_runner
from workers.tool_processes import pool as tool_processes

GIVE_UP_SECONDS = 60.0


@pytest.fixture
def processes(configure: Configure) -> Iterator[None]:
    """Tool processes of this test's own (ended after it), on the sample agents. (A change
    of the settings ends those started before it: they hold the environment of their start.)"""
    configure(RATCHET_AGENT_MODULES="tests.sample_agents")
    with tool_processes.fresh_pool():
        yield


def context(**secrets: str) -> ToolContext:
    return ToolContext(
        task_id="task-1",
        tenant_id="tenant-1",
        call_id="1:0",
        idempotency_key="task-1:1:0",
        secrets=secrets,
    )


def execute(name: str, **arguments: Any) -> tool_runner.Outcome:
    outcome, _ = bounded(
        lambda: tool_runner.execute(get_registry().tools[name], arguments, context()),
        give_up=GIVE_UP_SECONDS,
    )
    assert isinstance(outcome, tool_runner.Outcome), outcome
    return outcome


def pid_of_next_call() -> int:
    outcome = execute("whoami")
    assert outcome.ok, outcome
    return int(outcome.result["pid"])


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + GIVE_UP_SECONDS
    while not check():
        assert time.monotonic() < deadline, f"not {what} after {GIVE_UP_SECONDS:g} s"
        time.sleep(0.05)


def test_a_call_runs_in_a_tool_process_that_later_calls_reuse(processes: None) -> None:
    outcome, _ = bounded(
        lambda: tool_runner.execute(
            get_registry().tools["whoami"], {"echo": "é 😀"}, context(TOKEN="s3cret")
        )
    )
    assert outcome.ok, outcome  # what it printed went to stderr, not into its reply
    assert outcome.result["pid"] != os.getpid()
    assert outcome.result["echo"] == "é 😀"
    assert outcome.result["secrets"] == {"TOKEN": "s3cret"}
    assert outcome.result["key"] == "task-1:1:0"
    assert pid_of_next_call() == outcome.result["pid"]


# Each breaks its tool process in its own way; what the model reads says how.
HOSTILE = {
    "late_hook": ({"url": "http://127.0.0.1:9/never", "seconds": 30}, "timed out after 1 s"),
    "hog_memory": ({"gigabytes": 4}, "ran out of memory"),
    "fork_bomb": ({}, "started more than 32 processes"),
    "segfault": ({}, "killed by SIGSEGV"),
    "exit_abruptly": ({"status": 3}, "exit status 3"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_call_fails_with_its_outcome_unknown_and_its_process_is_replaced(
    processes: None, name: str
) -> None:
    before = pid_of_next_call()
    arguments, error = HOSTILE[name]
    outcome = execute(name, **arguments)
    assert not outcome.ok
    assert outcome.unknown, outcome  # it may have acted before it was stopped ...
    assert outcome.stopped, outcome  # ... but it does nothing more
    assert error in (outcome.error or ""), outcome
    assert cancels.abandoned() == 0  # no thread of the call pools was left holding it
    # Its whole process group is gone, reaped (no zombie left), and a new process serves on.
    wait_until(lambda: group_gone(before), "reaped")
    assert pid_of_next_call() != before


def test_a_call_past_its_cpu_seconds_is_ended(processes: None, configure: Configure) -> None:
    configure(RATCHET_TOOL_PROCESS_CPU_SECONDS="1")
    outcome = execute("burn_cpu")
    assert outcome.stopped
    assert "used more than 1 s of CPU" in (outcome.error or ""), outcome


def test_a_cancel_kills_the_call_in_its_process(
    processes: None, configure: Configure, tmp_path: Path
) -> None:
    journal = tmp_path / "journal"
    # ``upsert_slowly`` says nothing of where it runs: the setting sends it to a process.
    configure(RATCHET_TOOL_ISOLATION="process", RATCHET_TEST_JOURNAL=str(journal))
    raised: list[BaseException] = []

    def run() -> None:
        with cancels.watching("task-1"):
            try:
                tool_runner.execute(
                    get_registry().tools["upsert_slowly"], {"key": "k", "seconds": 600}, context()
                )
            except cancels.Interrupted as exc:
                raised.append(exc)

    step = threading.Thread(target=run, daemon=True)
    step.start()
    wait_until(journal.exists, "started")
    [pid] = [p.pid for p in tool_processes.current().calling()]
    cancels.cancel("task-1")
    step.join(GIVE_UP_SECONDS)
    assert raised, "the step did not stop waiting"
    wait_until(lambda: group_gone(pid), "killed")
    assert journal.read_text().count("upsert_slowly") == 1


def test_a_cancel_reaches_a_call_waiting_for_a_free_process(
    processes: None, configure: Configure, tmp_path: Path
) -> None:
    journal = tmp_path / "journal"
    configure(
        RATCHET_TOOL_ISOLATION="process",
        RATCHET_TEST_JOURNAL=str(journal),
        RATCHET_TOOL_PROCESS_POOL_SIZE="1",
    )
    raised: dict[str, BaseException] = {}

    def step(task_id: str) -> None:
        with cancels.watching(task_id):
            try:
                tool_runner.execute(
                    get_registry().tools["upsert_slowly"], {"key": "k", "seconds": 600}, context()
                )
            except cancels.Interrupted as exc:
                raised[task_id] = exc

    with tool_processes.fresh_pool() as one:
        running = threading.Thread(target=step, args=("task-1",), daemon=True)
        running.start()
        wait_until(journal.exists, "started")
        waiting = threading.Thread(target=step, args=("task-2",), daemon=True)
        waiting.start()  # the only process is busy: it waits for it

        def stopped() -> bool:  # (a cancel before its step began watching would be lost)
            cancels.cancel("task-2")
            return not waiting.is_alive()

        wait_until(stopped, "stopped waiting")
        assert "task-2" in raised
        assert len(one.calling()) == 1  # the first call runs on, untouched
        cancels.cancel("task-1")
        running.join(GIVE_UP_SECONDS)
    assert set(raised) == {"task-1", "task-2"}
    assert journal.read_text().count("upsert_slowly") == 1  # the second call never ran


def test_a_process_is_replaced_after_its_calls(processes: None, configure: Configure) -> None:
    configure(RATCHET_TOOL_PROCESS_MAX_CALLS="2")
    first = [pid_of_next_call() for _ in range(2)]
    assert first[0] == first[1]
    assert pid_of_next_call() != first[0]


def test_a_process_that_grew_is_replaced(processes: None, configure: Configure) -> None:
    configure(RATCHET_TOOL_PROCESS_RECYCLE_RSS_MB="64")
    before = pid_of_next_call()
    assert execute("grow", megabytes=100).ok
    assert pid_of_next_call() != before


def test_processes_a_call_leaves_behind_end_with_its_process(processes: None) -> None:
    before = pid_of_next_call()
    outcome = execute("spawn_sleeper", seconds=600)
    assert outcome.ok, outcome
    wait_until(lambda: group_gone(before), "ended")  # the sleeper was in its group
    assert not Path(f"/proc/{outcome.result}").exists()
    assert pid_of_next_call() != before


def test_a_tool_may_park_its_call_from_a_process(processes: None) -> None:
    outcome = execute("park_on_ci", run="r-1")
    assert outcome.parking is not None
    assert outcome.parking.request == {"run": "r-1"}
    assert outcome.parking.timeout_seconds == 60


def test_a_tool_the_tool_process_does_not_import_fails_its_call_plainly(
    processes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = get_registry().tools

    def only_here() -> str:
        """Defined in this process alone."""
        return "never"

    tool(isolation="process", name="only_here")(only_here)
    monkeypatch.setitem(tools, "only_here", tools["only_here"])  # removed after the test
    outcome = execute("only_here")
    assert not outcome.ok
    assert not outcome.unknown
    assert "RATCHET_AGENT_MODULES" in (outcome.error or "")


def test_calls_wait_for_a_free_process_and_all_run(processes: None, configure: Configure) -> None:
    configure(RATCHET_TOOL_PROCESS_POOL_SIZE="2", RATCHET_TOOL_ISOLATION="process")
    results: list[tool_runner.Outcome] = []
    with tool_processes.fresh_pool():
        threads = [
            threading.Thread(target=lambda: results.append(execute("sleep", seconds=0.2)))
            for _ in range(6)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(GIVE_UP_SECONDS)
    assert len(results) == 6
    assert all(outcome.ok for outcome in results), results


def test_only_python_tools_of_the_registry_run_isolated(configure: Configure) -> None:
    configure(RATCHET_TOOL_ISOLATION="process", RATCHET_AGENT_MODULES="tests.sample_agents")
    tools = get_registry().tools
    assert tool_runner.isolated(tools["calculator"])  # the setting sends it
    assert not tool_runner.isolated(tools["late_hook_in_thread"])  # its own word wins
    assert not tool_runner.isolated(tools["researcher"])  # a sub-agent runs as a task
