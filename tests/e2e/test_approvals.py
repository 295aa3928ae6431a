"""Approvals against real processes: ``ratchet api`` and ``ratchet worker`` over HTTP.

A tool call that waits for a person holds nothing while it waits; each decision is made once,
whoever asks and however often; an approved call runs once (with its edited arguments, if
edited), a rejected one never; a deadline applies its policy once; and a worker killed at
any point around the wait neither runs a call twice nor loses a decision.

Every task here runs the ``ops`` agent's ``wire_money``, which always asks first and is not
idempotent. Its runs are counted in the journal the sample agents' tools write
(``wire <task id>:<call id>`` per run). Its script is one turn, the call: past the end of its
script the scripted model answers with what the last tool said, so the task's output is what
the model read of the call (its result, or its rejection).

Each class shares one stack: an API and one worker process (``--concurrency=1``). The tests
that kill nothing run on a worker that runs at most ``STEP_THREADS`` steps at once (its step
threads, ``RATCHET_WORKER_THREADS``), far fewer than the tasks left waiting on it, so a
waiting task that held a slot would show. The crash tests run on a stack with short leases
and a fast sweeper, whose worker has every failpoint set to kill once but disarmed; a test
arms one, the process that reaches it is killed with SIGKILL, and the worker's pool starts a
new one in its place (or the test kills the whole worker and starts another).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import select
from standardwebhooks.webhooks import Webhook

from tests.conftest import TenantHandle
from tests.e2e.conftest import Stack, logs_on_failure, running_stack
from tests.e2e.test_crashes import FAST as CRASH_ENV
from tests.e2e.test_crashes import task_events, timeline, wait_for
from tests.e2e.test_delivery import current_secret, sse_events
from tests.e2e.util import wait_all
from tests.fakes.receiver import WebhookReceiver
from tests.helpers import TERMINAL, scripted_task, tool_turn

# The kill tests' workers leave unacked messages behind.
pytestmark = pytest.mark.usefixtures("forget_unacked")

WIRE = tool_turn("wire_money", to="alice", amount=900)
WIRED = "wired 900 to alice"
STEP_THREADS = 2
SWEEP_INTERVAL_SECONDS = 0.5
CALM_ENV = {
    "RATCHET_WORKER_THREADS": str(STEP_THREADS),
    "RATCHET_SWEEP_INTERVAL_SECONDS": str(SWEEP_INTERVAL_SECONDS),
    "RATCHET_SWEEP_GRACE_SECONDS": "3",
    "RATCHET_SHUTDOWN_GRACE_SECONDS": "0",
}
WAITING = "awaiting_approval"


# -- talking to the stack -----------------------------------------------------------------------


def start(http: httpx.Client, **extra: Any) -> str:
    """Submit a task whose one step asks to wire money; return its id."""
    response = http.post("/v1/tasks", json=scripted_task([WIRE], agent="ops", **extra))
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def decide(http: httpx.Client, task_id: str, decision: str, **body: Any) -> httpx.Response:
    return http.post(f"/v1/tasks/{task_id}/approvals/1-0", json={"decision": decision, **body})


def the_call(http: httpx.Client, task_id: str) -> dict[str, Any]:
    """The task's one tool call (its first step's), as the steps endpoint shows it."""
    first, *_ = timeline(http, task_id)
    [call] = first["tool_calls"]
    return dict(call)


def statuses(task_ids: Iterable[str]) -> dict[str, tuple[str, str | None]]:
    """(status, lease owner) of each task, read from the database in one query."""
    from shared.store.db import transaction
    from shared.store.tables import Task

    with transaction() as session:
        rows = session.execute(
            select(Task.id, Task.status, Task.lease_owner).where(Task.id.in_(list(task_ids)))
        ).all()
    return {row.id: (row.status, row.lease_owner) for row in rows}


def ledger_rows(task_ids: Iterable[str]) -> dict[str, tuple[str, int, str | None]]:
    """(status, runs, decision) of each task's tool calls, from the database in one query."""
    from shared.store.db import transaction
    from shared.store.tables import ToolCall

    with transaction() as session:
        rows = session.execute(
            select(ToolCall.task_id, ToolCall.status, ToolCall.runs, ToolCall.decision).where(
                ToolCall.task_id.in_(list(task_ids))
            )
        ).all()
    assert len({row.task_id for row in rows}) == len(rows), "a task with more than one call"
    return {row.task_id: (row.status, row.runs, row.decision) for row in rows}


def wait_until_waiting(task_ids: Iterable[str], timeout: float = 60.0) -> None:
    """Wait until every task waits for a decision; fail at once if one ended instead."""
    ids = list(task_ids)
    deadline = time.monotonic() + timeout
    while True:
        seen = statuses(ids)
        counts = Counter(status for status, _ in seen.values())
        if counts[WAITING] == len(ids):
            return
        ended = {i: s for i, (s, _) in seen.items() if s in TERMINAL}
        assert not ended, f"tasks ended instead of waiting for a decision: {ended}"
        assert time.monotonic() < deadline, f"not all waiting after {timeout} s: {dict(counts)}"
        time.sleep(0.1)


def journal_runs(journal: Path, task_ids: Iterable[str]) -> Counter[str]:
    """How many times ``wire_money`` ran for each call of these tasks (``<task>:<call>``)."""
    ids = set(task_ids)
    runs: Counter[str] = Counter()
    for line in journal.read_text().splitlines():
        kind, key = line.split()
        if key.partition(":")[0] in ids:
            assert kind == "wire", line
            runs[key] += 1
    return runs


def when(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def decision_events(task_id: str) -> list[dict[str, Any]]:
    """The ``step.tool_call`` events that record a decision (the call's later outcome, when
    it runs or is turned down, is an event without ``decided_by``)."""
    return [d for t, d in task_events(task_id) if t == "step.tool_call" and d.get("decided_by")]


# -- the stacks -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The journal of every stack of this module (each test reads its own tasks' lines)."""
    path = tmp_path_factory.mktemp("approvals") / "journal"
    path.touch()
    return path


# Each stack is class-scoped, one API and one worker process (``--concurrency=1``) for every
# test of a class, and stopped before the next class starts its own: every worker sweeps the
# whole database, and must not pick up another stack's tasks.
@pytest.fixture(scope="class")
def calm_stack(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, journal: Path
) -> Iterator[Stack]:
    """The stack of the tests that kill nothing: few step threads, a fast sweeper."""
    env = {**CALM_ENV, "RATCHET_TEST_JOURNAL": str(journal)}
    with running_stack(
        service_env, tmp_path_factory.mktemp("calm"), queue="approvals", env=env
    ) as started:
        yield started


@pytest.fixture
def fleet(calm_stack: Stack, request: pytest.FixtureRequest) -> Iterator[Stack]:
    yield from logs_on_failure(calm_stack, request)


class TestDecisions:
    @pytest.mark.parametrize(
        ("decision", "body", "arguments"),
        [
            ("approve", {}, {"to": "alice", "amount": 900}),
            ("edit", {"arguments": {"to": "bob", "amount": 5}}, {"to": "bob", "amount": 5}),
            ("reject", {"reason": "wrong account"}, {"to": "alice", "amount": 900}),
        ],
        ids=["approve", "edit", "reject"],
    )
    def test_a_decision_runs_the_call_once_as_decided_or_never(
        self,
        fleet: Stack,
        tenant: TenantHandle,
        journal: Path,
        decision: str,
        body: dict[str, Any],
        arguments: dict[str, Any],
    ) -> None:
        with fleet.client(headers=tenant.headers) as http:
            task_id = start(http)
            wait_until_waiting([task_id])
            waiting = http.get(f"/v1/tasks/{task_id}").json()
            ran_while_waiting = journal_runs(journal, [task_id])
            answer = decide(http, task_id, decision, **body)
            task = wait_all(http, None, [task_id], timeout=60)[task_id]
            call = the_call(http, task_id)
            again = decide(http, task_id, decision, **body)
            other = decide(http, task_id, "approve" if decision == "reject" else "reject")

        assert waiting["status"] == WAITING
        [pending] = waiting["pending_approval"]["calls"]
        assert (pending["call_id"], pending["tool"]) == ("1-0", "wire_money")
        assert pending["arguments"] == {"to": "alice", "amount": 900}
        assert ran_while_waiting == Counter()
        assert answer.status_code == 200, answer.text
        assert (answer.json()["decision"], answer.json()["replayed"]) == (decision, False)
        assert answer.json()["task"]["status"] == "running"

        assert task["status"] == "succeeded", task
        runs = journal_runs(journal, [task_id])
        approval = call["approval"]
        assert approval["decision"] == decision
        assert approval["decided_by"].startswith("key:")
        assert call["arguments"] == arguments
        if decision == "reject":
            assert runs == Counter()
            assert (call["status"], call["runs"]) == ("failed", 0)
            assert approval["reason"] == "wrong account"
            assert "rejected" in task["result"]["output"]  # what the model read
            assert "wrong account" in task["result"]["output"]
        else:
            assert runs == {f"{task_id}:1-0": 1}
            expected = f"wired {arguments['amount']} to {arguments['to']}"  # as decided
            assert (call["status"], call["runs"], call["result"]) == ("succeeded", 1, expected)
            assert task["result"]["output"] == expected
            edited = decision == "edit"
            assert approval["original_arguments"] == (pending["arguments"] if edited else None)
        assert len(decision_events(task_id)) == 1

        # Decided once: the same decision again is answered with the stored one, another is
        # turned away; neither changes anything.
        assert again.status_code == 200, again.text
        assert again.json()["replayed"] is True
        assert again.json()["decided_at"] == answer.json()["decided_at"]
        assert other.status_code == 409, other.text
        assert other.headers["content-type"].startswith("application/problem+json")
        assert journal_runs(journal, [task_id]) == runs

    def test_two_hundred_waiting_tasks_hold_no_slot_and_each_runs_once_when_approved(
        self, fleet: Stack, tenant: TenantHandle, journal: Path
    ) -> None:
        waiting_count, ordinary_count = 200, 20
        with fleet.client(headers=tenant.headers) as http, ThreadPoolExecutor(8) as pool:
            waiting = list(pool.map(lambda _: start(http), range(waiting_count)))
            wait_until_waiting(waiting, timeout=120)
            # The worker runs at most STEP_THREADS steps at once: a waiting task that held
            # one would leave these stuck behind it.
            ordinary = []
            for n in range(ordinary_count):
                response = http.post("/v1/tasks", json=scripted_task([{"content": f"o{n}"}]))
                assert response.status_code == 202, response.text
                ordinary.append(response.json()["id"])
            finished = wait_all(http, None, ordinary, timeout=90)
            while_waiting = statuses(waiting)
            ran_while_waiting = journal_runs(journal, waiting)

            answers = list(pool.map(lambda t: decide(http, t, "approve"), waiting))
            done = wait_all(http, None, waiting, timeout=180)

        assert {t["status"] for t in finished.values()} == {"succeeded"}
        assert {t["result"]["output"] for t in finished.values()} == {
            f"o{n}" for n in range(ordinary_count)
        }
        # Still waiting once the others were done, and holding no lease.
        assert set(while_waiting.values()) == {(WAITING, None)}
        assert ran_while_waiting == Counter()

        assert [a.status_code for a in answers] == [200] * waiting_count, [
            a.text for a in answers if a.status_code != 200
        ]
        assert {a.json()["replayed"] for a in answers} == {False}
        assert Counter(t["status"] for t in done.values()) == {"succeeded": waiting_count}
        assert {t["result"]["output"] for t in done.values()} == {WIRED}
        assert journal_runs(journal, waiting) == {f"{t}:1-0": 1 for t in waiting}
        assert ledger_rows(waiting) == dict.fromkeys(waiting, ("succeeded", 1, "approve"))

    def test_concurrent_conflicting_decisions_store_exactly_one(
        self, fleet: Stack, tenant: TenantHandle, journal: Path
    ) -> None:
        sent = ["approve", "reject"] * 10
        barrier = threading.Barrier(len(sent))

        def fire(decision: str) -> httpx.Response:
            with httpx.Client(base_url=fleet.url, headers=tenant.headers, timeout=30) as own:
                barrier.wait(timeout=30)
                return decide(own, task_id, decision)

        with fleet.client(headers=tenant.headers) as http:
            task_id = start(http)
            wait_until_waiting([task_id])
            with ThreadPoolExecutor(max_workers=len(sent)) as pool:
                answers = list(pool.map(fire, sent))
            task = wait_all(http, None, [task_id], timeout=60)[task_id]
            call = the_call(http, task_id)

        stored = call["approval"]["decision"]
        assert stored in ("approve", "reject")
        # Every request with the stored decision is answered with it; every other is a 409.
        for decision, answer in zip(sent, answers, strict=True):
            if decision == stored:
                assert answer.status_code == 200, answer.text
                assert answer.json()["decision"] == stored
                assert answer.json()["decided_at"] == call["approval"]["decided_at"]
            else:
                assert answer.status_code == 409, answer.text
                assert answer.headers["content-type"].startswith("application/problem+json")
        first = [a for a in answers if a.status_code == 200 and not a.json()["replayed"]]
        assert len(first) == 1, [a.json() for a in answers if a.status_code == 200]
        assert len(decision_events(task_id)) == 1

        assert task["status"] == "succeeded", task
        runs = journal_runs(journal, [task_id])
        if stored == "approve":
            assert runs == {f"{task_id}:1-0": 1}
            assert (call["status"], call["runs"], call["result"]) == ("succeeded", 1, WIRED)
        else:
            assert runs == Counter()
            assert (call["status"], call["runs"]) == ("failed", 0)

    def test_a_deadline_rejects_once_and_a_racing_decision_wins_or_gets_a_409(
        self, fleet: Stack, tenant: TenantHandle, journal: Path
    ) -> None:
        policy = {"tools": [], "timeout_seconds": 2, "on_timeout": "reject"}
        with fleet.client(headers=tenant.headers) as http:
            expired, raced = start(http, approval=policy), start(http, approval=policy)
            # Recorded as waiting; the status is not waited for, as the deadline may come first.
            wait_for("both calls to wait", lambda: len(ledger_rows([expired, raced])) == 2)
            # The call's deadline to the millisecond (the task's copy is to the second).
            deadline = when(the_call(http, raced)["approval"]["deadline"])
            # Halfway through a sweep interval past the deadline: either may get there first.
            time.sleep(max(0.0, deadline + SWEEP_INTERVAL_SECONDS / 2 - time.time()))
            racing = decide(http, raced, "approve")
            tasks = wait_all(http, None, [expired, raced], timeout=60)
            calls = {task_id: the_call(http, task_id) for task_id in (expired, raced)}
            late = decide(http, expired, "approve")

        # Nobody decided the first one: the deadline rejected it, once, not before it passed.
        task, call = tasks[expired], calls[expired]
        approval = call["approval"]
        assert task["status"] == "succeeded", task
        assert (approval["decision"], approval["decided_by"]) == ("reject", "timeout")
        assert approval["on_timeout"] == "reject"
        assert when(approval["decided_at"]) >= when(approval["deadline"])
        assert (call["status"], call["runs"]) == ("failed", 0)
        assert "rejected by timeout" in task["result"]["output"]
        assert [e["decided_by"] for e in decision_events(expired)] == ["timeout"]
        assert late.status_code == 409, late.text
        assert journal_runs(journal, [expired]) == Counter()

        # The second one: the person's approval won, or it was told the deadline had.
        task, call = tasks[raced], calls[raced]
        approval = call["approval"]
        assert task["status"] == "succeeded", task
        assert len(decision_events(raced)) == 1
        if racing.status_code == 200:
            assert (approval["decision"], approval["decided_by"]) == (
                "approve",
                racing.json()["decided_by"],
            )
            assert journal_runs(journal, [raced]) == {f"{raced}:1-0": 1}
            assert task["result"]["output"] == WIRED
        else:
            assert racing.status_code == 409, racing.text
            assert racing.headers["content-type"].startswith("application/problem+json")
            assert (approval["decision"], approval["decided_by"]) == ("reject", "timeout")
            assert when(approval["decided_at"]) >= when(approval["deadline"])
            assert journal_runs(journal, [raced]) == Counter()
        print(f"the racing decision was answered {racing.status_code}")

    def test_the_event_stream_and_a_webhook_carry_the_pending_call(
        self, fleet: Stack, tenant: TenantHandle
    ) -> None:
        events = ["task.awaiting_approval", "task.succeeded"]
        timeout = httpx.Timeout(30.0, read=20.0)
        with (
            WebhookReceiver() as receiver,
            fleet.client(headers=tenant.headers) as http,
            httpx.Client(base_url=fleet.url, headers=tenant.headers, timeout=timeout) as reader,
        ):
            task_id = start(http, webhook={"url": receiver.url("/approvals"), "events": events})
            with reader.stream("GET", f"/v1/tasks/{task_id}/events") as response:
                assert response.status_code == 200, response.read()
                stream = sse_events(response)
                before = []
                for event in stream:
                    if event.live:
                        continue  # the model's answer as it streamed: not the log
                    before.append(event)
                    if event.type == "task.awaiting_approval":
                        break
                [hooked] = receiver.wait_for(1, path="/approvals", timeout=30)
                answer = decide(http, task_id, "approve")
                # To the end of the stream, which ends with the task.
                after = [event for event in stream if not event.live]
            hooks = receiver.wait_for(2, path="/approvals", timeout=30)

        assert answer.status_code == 200, answer.text
        assert [e.type for e in before] == [
            "task.queued",
            "task.started",
            "step.model_response",
            "task.awaiting_approval",
        ]
        [pending] = before[-1].data["pending_approval"]["calls"]
        assert before[-1].data["status"] == WAITING
        assert (pending["call_id"], pending["tool"]) == ("1-0", "wire_money")
        assert pending["arguments"] == {"to": "alice", "amount": 900}
        assert (pending["on_timeout"], bool(pending["deadline"])) == ("reject", True)
        decided = [e.data for e in after if e.type == "step.tool_call"]
        assert decided[0]["decision"] == "approve"
        assert after[-1].type == "task.succeeded"
        assert [e.seq for e in before + after] == list(range(1, len(before) + len(after) + 1))

        secret = current_secret(tenant)
        payloads = [Webhook(secret).verify(h.body, dict(h.headers)) for h in hooks]
        assert [p["type"] for p in payloads] == events
        assert hooks[0] == hooked  # sent while the task waited
        assert payloads[0]["data"]["id"] == task_id
        assert payloads[0]["data"]["status"] == WAITING
        assert payloads[0]["data"]["pending_approval"]["calls"] == [pending]


# -- kills around the wait ----------------------------------------------------------------------

# Where a test kills the worker: the step's failpoints, each armed by one test at a time.
KILL_POINTS = ("after_model_commit", "tool_call", "after_tool")
# How many times an approved call ran when its process was killed at each point of its run.
RUNS_AT = {"tool_call": 0, "after_tool": 1}


@pytest.fixture(scope="class")
def kill_markers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A ``kill_once`` marker per failpoint. A failpoint kills only the process that creates
    its marker: while the file exists, it is disarmed (see :func:`armed`)."""
    directory = tmp_path_factory.mktemp("markers")
    markers = {point: directory / point for point in KILL_POINTS}
    for marker in markers.values():
        marker.touch()
    return markers


@pytest.fixture(scope="class")
def kill_stack(
    service_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
    journal: Path,
    kill_markers: dict[str, Path],
) -> Iterator[Stack]:
    """Short leases and a fast sweeper (a killed step is taken over within seconds); every
    failpoint set to kill once, and disarmed."""
    failpoints = ",".join(f"{point}=kill_once:{m}" for point, m in kill_markers.items())
    env = {**CRASH_ENV, "RATCHET_TEST_JOURNAL": str(journal), "RATCHET_FAILPOINTS": failpoints}
    with running_stack(
        service_env, tmp_path_factory.mktemp("kills"), queue="approval-kills", env=env
    ) as started:
        yield started


@pytest.fixture
def kill_fleet(kill_stack: Stack, request: pytest.FixtureRequest) -> Iterator[Stack]:
    yield from logs_on_failure(kill_stack, request)


def drop_queued_steps(fleet: Stack) -> int:
    """Delete the step messages waiting in the stack's queue, as a lost publish or a flushed
    broker would; return how many there were."""
    queue = fleet.env["RATCHET_QUEUE_NAME"]
    with redis.Redis.from_url(fleet.env["RATCHET_REDIS_URL"]) as conn:
        waiting = int(conn.llen(queue))
        conn.delete(queue)
    return waiting


def live_worker(fleet: Stack) -> int:
    [index] = [i for i, proc in enumerate(fleet.worker_procs) if proc.poll() is None]
    return index


@contextlib.contextmanager
def armed(fleet: Stack, marker: Path) -> Iterator[Callable[[], None]]:
    """Arm a failpoint: the next process to reach it is killed (SIGKILL), and the worker's
    pool puts a new process in its place. Yields a function that waits for the kill."""
    index = live_worker(fleet)
    before = set(fleet.worker_child_pids(index))
    marker.unlink()

    def killed() -> None:
        wait_for("a process to reach the failpoint", marker.exists, timeout=60)
        wait_for(
            "the killed process to be gone",
            lambda: not before & set(fleet.worker_child_pids(index)),
            timeout=30,
        )

    try:
        yield killed
    finally:
        marker.touch()  # disarmed again, whatever happened


class TestKills:
    def test_a_worker_killed_right_after_the_model_answered_still_puts_the_task_to_wait(
        self,
        kill_fleet: Stack,
        tenant: TenantHandle,
        journal: Path,
        kill_markers: dict[str, Path],
    ) -> None:
        with (
            kill_fleet.client(headers=tenant.headers) as http,
            armed(kill_fleet, kill_markers["after_model_commit"]) as killed,
        ):
            task_id = start(http)
            killed()
            # The lease of the killed process runs out; the process put in its place runs
            # the step again, from its committed answer.
            wait_until_waiting([task_id])
            waiting = http.get(f"/v1/tasks/{task_id}").json()
            ran_while_waiting = journal_runs(journal, [task_id])
            types = [t for t, _ in task_events(task_id)]
            answer = decide(http, task_id, "approve")
            task = wait_all(http, None, [task_id], timeout=60)[task_id]
            call = the_call(http, task_id)

        assert [c["call_id"] for c in waiting["pending_approval"]["calls"]] == ["1-0"]
        assert ran_while_waiting == Counter()
        # The committed answer was used again, not asked for again; the wait recorded once.
        assert types.count("step.model_response") == 1, types
        assert types.count("task.awaiting_approval") == 1, types
        assert types[-1] == "task.awaiting_approval", types
        assert answer.status_code == 200, answer.text
        assert task["status"] == "succeeded", task
        assert task["result"]["output"] == WIRED
        assert journal_runs(journal, [task_id]) == {f"{task_id}:1-0": 1}
        assert (call["status"], call["runs"]) == ("succeeded", 1)
        assert call["approval"]["decision"] == "approve"

    def test_a_worker_killed_while_tasks_wait_changes_nothing_and_loses_no_decision(
        self, kill_fleet: Stack, tenant: TenantHandle, journal: Path
    ) -> None:
        with kill_fleet.client(headers=tenant.headers) as http:
            later, meanwhile = start(http), start(http)
            wait_until_waiting([later, meanwhile])
            kill_fleet.kill_worker(live_worker(kill_fleet))  # SIGKILL, its pool included
            after_kill = statuses([later, meanwhile])
            # One is decided while no worker runs: the decision is in the database and the
            # task back in the backlog (no message that a flushed broker could lose); the new
            # worker's dispatcher admits it.
            lost = decide(http, meanwhile, "approve")
            dropped = drop_queued_steps(kill_fleet)
            kill_fleet.start_worker()
            answer = decide(http, later, "approve")
            tasks = wait_all(http, None, [later, meanwhile], timeout=60)
            calls = {task_id: the_call(http, task_id) for task_id in tasks}

        assert after_kill == dict.fromkeys([later, meanwhile], (WAITING, None))
        assert (lost.status_code, answer.status_code) == (200, 200), (lost.text, answer.text)
        assert dropped == 0  # nothing was sent while no dispatcher ran
        for task_id, task in tasks.items():
            assert task["status"] == "succeeded", task
            assert task["result"]["output"] == WIRED
            call = calls[task_id]
            assert (call["status"], call["runs"]) == ("succeeded", 1)
            assert call["approval"]["decision"] == "approve"
        assert journal_runs(journal, tasks) == {f"{t}:1-0": 1 for t in tasks}

    @pytest.mark.parametrize("point", list(RUNS_AT))
    def test_a_worker_killed_running_an_approved_call_never_runs_it_again(
        self,
        point: str,
        kill_fleet: Stack,
        tenant: TenantHandle,
        journal: Path,
        kill_markers: dict[str, Path],
    ) -> None:
        with kill_fleet.client(headers=tenant.headers) as http:
            task_id = start(http)
            wait_until_waiting([task_id])
            with armed(kill_fleet, kill_markers[point]) as killed:
                answer = decide(http, task_id, "approve", reason="go")
                killed()
            task = wait_all(http, None, [task_id], timeout=60)[task_id]
            call = the_call(http, task_id)
            again = decide(http, task_id, "approve", reason="go")
            other = decide(http, task_id, "reject")

        assert answer.status_code == 200, answer.text
        # wire_money is not idempotent: a run whose outcome is unknown is never run again,
        # and its policy fails the task.
        assert task["status"] == "failed", task
        assert task["error"]["type"] == "tool_outcome_unknown", task
        runs = journal_runs(journal, [task_id])
        assert sum(runs.values()) == RUNS_AT[point], runs
        assert (call["status"], call["runs"]) == ("failed", 1), call
        # The decision is kept, and still answered as it was made.
        approval = call["approval"]
        assert (approval["decision"], approval["reason"]) == ("approve", "go")
        assert approval["decided_by"] == answer.json()["decided_by"]
        assert again.status_code == 200, again.text
        assert again.json()["replayed"] is True
        assert other.status_code == 409, other.text
        assert len(decision_events(task_id)) == 1
