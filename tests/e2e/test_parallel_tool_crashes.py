"""DESIGN §5 for a step whose calls run at once, against real processes: a worker killed
after the first of three parallel outcomes committed, while the other two still ran. The task
succeeds on another worker; the committed call is replayed, never run again, and the two cut
short run again (their tool is idempotent), each run counted in the sample tools' journal.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory
from tests.e2e.test_crashes import KillOnce, check_no_duplicates, submit_all, timeline
from tests.e2e.util import wait_all
from tests.helpers import scripted_task

# The fast call takes long enough for the slow ones to have started beside it (their rows
# and first runs written) when its outcome commits; they are still running at the kill.
FAST_SECONDS, SLOW_SECONDS = 1.0, 6.0


def test_a_kill_after_the_first_parallel_outcome_runs_no_committed_call_again(
    stack: StackFactory, tenant: TenantHandle, tmp_path: Path
) -> None:
    journal = tmp_path / "journal"
    journal.touch()
    env = {"RATCHET_TEST_JOURNAL": str(journal)}
    kill = KillOnce.start(stack, "after_call_commit", marker=tmp_path / "killed", env=env)
    calls = [
        {"name": "upsert_slowly", "arguments": {"key": "fast", "seconds": FAST_SECONDS}},
        {"name": "upsert_slowly", "arguments": {"key": "slow-1", "seconds": SLOW_SECONDS}},
        {"name": "upsert_slowly", "arguments": {"key": "slow-2", "seconds": SLOW_SECONDS}},
    ]
    script = [{"tool_calls": calls}, {"content": "stored"}]
    with kill.fleet.client(headers=tenant.headers) as http:
        [task_id] = submit_all(http, {"fan": scripted_task(script, agent="crew")})
        task = wait_all(http, None, [task_id], timeout=90)[task_id]
        steps = timeline(http, task_id)

    kill.check_killed()
    assert task["status"] == "succeeded", task
    check_no_duplicates(task_id, steps, expected_steps=2)

    runs = Counter(journal.read_text().splitlines())
    [first] = [step["tool_calls"] for step in steps[:1]]
    assert [call["status"] for call in first] == ["succeeded"] * 3, first
    by_call = {call["call_id"]: call["runs"] for call in first}
    for call_id, ledger_runs in by_call.items():
        assert runs[f"upsert_slowly {task_id}:{call_id}"] == ledger_runs, (runs, by_call)
    # The fast call committed before the kill: never run again. The slow ones were cut short
    # by it, and ran once more after.
    assert by_call == {"1-0": 1, "1-1": 2, "1-2": 2}
