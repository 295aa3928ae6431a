"""DESIGN §5 against real processes: workers killed, paused and duplicated; Redis and Postgres
pulled away mid-run. Every task still ends; no committed model call is made again, and a side
effect is repeated only when a crash cut it short, with the same idempotency key.

Each test starts its own stack (``ratchet api`` + ``ratchet worker`` processes on this run's
Postgres and Redis) with short leases and a fast sweeper, so a dead worker's task is picked up
again within seconds. The LLM is faked at its transport: the ``scripted`` model, or the
OpenAI-compatible test server with a responder that derives (task, step) from each request, so
model calls can be counted across processes. Side effects land in this process: an HTTP
receiver that records every request's ``Idempotency-Key``, or the journal file of the sample
agents' tools.
"""

from __future__ import annotations

import abc
import bisect
import contextlib
import itertools
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Self

import httpx
import psycopg
import pytest
import redis
from celery import Celery
from sqlalchemy import exc as sa_exc
from sqlalchemy import select, text
from sqlalchemy.engine import make_url

from tests.conftest import IN_CI, TenantHandle
from tests.e2e.conftest import Stack, StackFactory, free_port
from tests.e2e.util import wait_all
from tests.fakes.openai_server import Call, Completion, OpenAIServer, Received, Reply, answer, stall
from tests.fakes.receiver import Received as Delivery
from tests.fakes.receiver import WebhookReceiver
from tests.helpers import TERMINAL, scripted_task, tool_turn

# Killed workers leave unacked messages behind.
pytestmark = pytest.mark.usefixtures("forget_unacked")

MODEL = "openai:gpt-crash-test"
LEASE_TTL_SECONDS = 2.0
FAST = {
    "RATCHET_LEASE_TTL_SECONDS": str(LEASE_TTL_SECONDS),
    "RATCHET_SWEEP_INTERVAL_SECONDS": "0.5",
    "RATCHET_SWEEP_GRACE_SECONDS": "1",
    "RATCHET_HTTP_ALLOWED_HOSTS": "127.0.0.1",
    # At teardown, requeue delayed retries at once instead of waiting for them.
    "RATCHET_SHUTDOWN_GRACE_SECONDS": "0",
}
TASK_MARKER = re.compile(r"\[task (?P<label>[\w.-]+)\]")


# -- side effects: the tool calls' HTTP requests, to a receiver in this process ----------------

EFFECTS = "/effects"
KEY = "idempotency-key"


def sent_body(request: Delivery) -> Any:
    """What the request carried, or None when a kill cut its body short."""
    try:
        return request.json()
    except ValueError:
        return None


# -- the model: replies computed from each request --------------------------------------------


@dataclass(frozen=True)
class Asked:
    """One model request: whose step it was and the id its reply carried."""

    label: str
    step: int
    reply: str
    at: float


class PostingAgent:
    """A responder for the fake OpenAI server: each step POSTs to the receiver, then it answers.

    A task is recognised by the ``[task <label>]`` marker in its input, and its step by the
    number of assistant messages so far. Every reply carries an id of its own (in the tool
    call's id, or the final answer's text), so the step timeline tells which request's
    answer was committed.
    """

    def __init__(
        self,
        receiver: WebhookReceiver,
        *,
        tool_steps: int,
        delay: float = 0.0,
        hold_answers: threading.Event | None = None,
    ) -> None:
        self.receiver = receiver
        self.tool_steps = tool_steps
        self.delay = delay
        # Final answers wait for this (if given), so that no task can end before it is set.
        self.hold_answers = hold_answers
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._asked: list[Asked] = []

    def __call__(self, request: Received) -> Reply:
        messages = request.messages
        found = TASK_MARKER.search(" ".join(str(m.get("content")) for m in messages))
        assert found is not None, messages
        label = found["label"]
        step = 1 + sum(m["role"] == "assistant" for m in messages)
        reply_id = f"{label}.{step}.{next(self._ids)}"
        with self._lock:
            self._asked.append(Asked(label, step, reply_id, request.at))
        reply: Completion
        if step <= self.tool_steps:
            arguments: dict[str, Any] = {
                "url": self.receiver.url(EFFECTS),
                "method": "POST",
                "json": {"task": label, "step": step},
            }
            reply = Completion(calls=(Call("http_request", arguments, id=f"call-{reply_id}"),))
        else:
            if self.hold_answers is not None:
                self.hold_answers.wait(HOLD_LIMIT_SECONDS)  # bounded: a failure, not a hang
            reply = answer(f"{label} done; reply {reply_id}")
        return stall(self.delay, reply) if self.delay else reply

    def asked(self) -> dict[tuple[str, int], list[Asked]]:
        """Every request by (task label, step), in order of arrival."""
        grouped: dict[tuple[str, int], list[Asked]] = defaultdict(list)
        with self._lock:
            for asked in sorted(self._asked, key=lambda a: a.at):
                grouped[(asked.label, asked.step)].append(asked)
        return grouped


def committed_reply(step: Mapping[str, Any]) -> str:
    """The reply id of the model answer a step committed."""
    model = step["model"]
    if model["tool_calls"]:
        return str(model["tool_calls"][0]["id"]).removeprefix("call-")
    return str(model["content"]).rpartition("reply ")[2]


def model_env(server: OpenAIServer) -> dict[str, str]:
    return {
        "RATCHET_OPENAI_BASE_URL": server.base_url,
        "RATCHET_OPENAI_API_KEY": "sk-test",
        "RATCHET_MODEL_TIMEOUT_SECONDS": "20",
    }


def posting_task(label: str) -> dict[str, Any]:
    return {"input": f"[task {label}] post the updates", "model": MODEL, "tools": ["http_request"]}


# -- talking to the stack -----------------------------------------------------------------------


def submit_all(http: httpx.Client, bodies: Mapping[str, dict[str, Any]]) -> dict[str, str]:
    """Submit each body; return task id → label."""
    ids = {}
    for label, body in bodies.items():
        response = http.post("/v1/tasks", json=body)
        assert response.status_code == 202, response.text
        ids[response.json()["id"]] = label
    return ids


def timeline(http: httpx.Client, task_id: str) -> list[dict[str, Any]]:
    response = http.get(f"/v1/tasks/{task_id}/steps", params={"limit": 200})
    assert response.status_code == 200, response.text
    return list(response.json()["items"])


def task_events(task_id: str) -> list[tuple[str, dict[str, Any]]]:
    """The task's events (type, data), checked to be numbered 1, 2, 3 … without a gap."""
    from shared.store.db import transaction
    from shared.store.tables import TaskEvent

    with transaction() as session:
        rows = session.execute(
            select(TaskEvent.seq, TaskEvent.type, TaskEvent.data)
            .where(TaskEvent.task_id == task_id)
            .order_by(TaskEvent.seq)
        ).all()
    assert [row.seq for row in rows] == list(range(1, len(rows) + 1)), rows
    return [(row.type, row.data) for row in rows]


def event_types(task_id: str) -> list[str]:
    return [type_ for type_, _ in task_events(task_id)]


def check_no_duplicates(task_id: str, steps: list[dict[str, Any]], *, expected_steps: int) -> None:
    """Each step committed once, each tool call once, and one event for each of them."""
    assert [s["number"] for s in steps] == list(range(1, expected_steps + 1)), steps
    assert all(s["status"] == "completed" for s in steps), steps
    calls = [(s["number"], c["call_id"]) for s in steps for c in s["tool_calls"]]
    assert len(calls) == len(set(calls)), calls
    events = task_events(task_id)
    seen = Counter(
        (type_, data.get("step"), data.get("call_id"))
        for type_, data in events
        if type_.startswith("step.")
    )
    expected = Counter(
        [("step.model_response", s["number"], None) for s in steps]
        + [("step.completed", s["number"], None) for s in steps]
        + [("step.tool_call", number, call_id) for number, call_id in calls]
    )
    assert seen == expected, events
    types = Counter(type_ for type_, _ in events)
    assert types["task.started"] == 1, types
    assert sum(types[t] for t in ("task.succeeded", "task.failed", "task.cancelled")) == 1, types


def lease_of(task_id: str) -> tuple[str | None, int]:
    """(lease_owner, lease_epoch) of a task; the owner is ``host:pid:thread``."""
    from shared.store.db import transaction
    from shared.store.tables import Task

    with transaction() as session:
        row = session.execute(
            select(Task.lease_owner, Task.lease_epoch).where(Task.id == task_id)
        ).one()
    return row.lease_owner, row.lease_epoch


def owner_pid(owner: str) -> int:
    return int(owner.split(":")[-2])


def row_locked(task_id: str) -> bool:
    """Whether some transaction holds the task's row lock right now."""
    from shared.store.db import transaction
    from shared.store.tables import Task

    try:
        with transaction() as session:
            session.execute(select(Task.id).where(Task.id == task_id).with_for_update(nowait=True))
    except sa_exc.OperationalError as exc:
        if getattr(exc.orig, "sqlstate", None) == "55P03":  # lock_not_available
            return True
        raise
    return False


def holders() -> list[tuple[str, str, str]]:
    """What the sessions holding row locks on tasks are doing (for failure messages)."""
    from shared.store.db import transaction

    with transaction() as session:
        rows = session.execute(
            text(
                "SELECT a.state, a.wait_event_type || ':' || coalesce(a.wait_event, ''), a.query"
                " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE l.relation = 'tasks'::regclass AND l.mode = 'RowExclusiveLock'"
            )
        ).all()
    return [(r[0], r[1], r[2][:300]) for r in rows]


def client_ports(pids: Iterable[int]) -> set[int]:
    """The local ports of the TCP sockets the given processes hold (from /proc)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:["):
                        inodes.add(link.removeprefix("socket:[").removesuffix("]"))
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports


def open_transactions(pids: Iterable[int]) -> list[str]:
    """The statements of the database sessions of these processes that are not idle."""
    from shared.store.db import transaction

    with transaction() as session:
        rows = session.scalars(
            text(
                "SELECT query FROM pg_stat_activity WHERE datname = current_database() "
                "AND client_port = ANY(:ports) AND state <> 'idle'"
            ),
            {"ports": sorted(client_ports(pids))},
        ).all()
    return list(rows)


def wait_for(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def all_logs(fleet: Stack) -> str:
    return "\n".join(fleet.log_text(f"worker-{i}") for i in range(len(fleet.worker_procs)))


def worker_of(fleet: Stack, pid: int) -> int:
    """The index of the worker whose pool process ``pid`` is."""
    for index in range(len(fleet.worker_procs)):
        if pid in fleet.worker_child_pids(index):
            return index
    raise AssertionError(f"pid {pid} is no worker's pool process")


def pool_pids(fleet: Stack) -> set[int]:
    """Every live pool process of every worker."""
    return {pid for i in range(len(fleet.worker_procs)) for pid in fleet.worker_child_pids(i)}


@dataclass
class KillOnce:
    """Two workers of one pool process each, whose first process to reach the failpoint is
    killed there, once (it leaves ``marker``); the pool processes as they stood at the start."""

    fleet: Stack
    marker: Path
    started: set[int]

    @classmethod
    def start(
        cls, stack: StackFactory, point: str, *, marker: Path, env: Mapping[str, str]
    ) -> Self:
        failpoint = {"RATCHET_FAILPOINTS": f"{point}=kill_once:{marker}"}
        fleet = stack(workers=2, concurrency=1, env={**FAST, **env, **failpoint})
        return cls(fleet, marker, pool_pids(fleet))

    def check_killed(self) -> None:
        """The failpoint was reached, and the one process there was killed."""
        assert self.marker.exists(), "no worker reached the failpoint"
        killed = self.started - pool_pids(self.fleet)
        assert len(killed) == 1, "the process at the failpoint was not killed"


# -- 1. chaos -----------------------------------------------------------------------------------


# How long after a worker sent a request a test server may read it, at most, on a busy machine.
READ_LAG_SECONDS = 1.0


class Killer:
    """Kills a random worker (SIGKILL to its whole process group) every ``every`` seconds,
    starting a replacement each time, ``limit`` times or until stopped."""

    def __init__(
        self,
        fleet: Stack,
        *,
        every: float,
        limit: int,
        seed: int = 0,
        done: threading.Event | None = None,
    ) -> None:
        self.fleet = fleet
        self.every = every
        self.limit = limit
        self.done = done or threading.Event()  # set once the last kill's replacement started
        self.kills: list[float] = []  # time.monotonic() of each kill
        self.error: BaseException | None = None
        self._random = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="killer", daemon=True)

    def _run(self) -> None:
        try:
            # The next kill is due ``every`` s after the last one, or once its replacement is
            # ready if starting it took longer, so that two workers or more always run.
            while len(self.kills) < self.limit and not self._stop.wait(
                max(0.0, self.every - self._since_last_kill())
            ):
                live = [i for i, p in enumerate(self.fleet.worker_procs) if p.poll() is None]
                self.kills.append(time.monotonic())
                self.fleet.kill_worker(self._random.choice(live))
                self.fleet.start_worker()
        except BaseException as exc:  # reported by the test, not lost in a thread
            self.error = exc
        finally:
            self.done.set()

    def _since_last_kill(self) -> float:
        return time.monotonic() - self.kills[-1] if self.kills else 0.0

    def __enter__(self) -> Killer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=90)
        assert not self._thread.is_alive(), "the killer did not stop"
        if self.error is not None:
            raise self.error

    def killed_between(self, start: float, end: float) -> bool:
        """Whether a kill fell between a request that arrived at ``start`` and its repeat at
        ``end``. ``start`` is when a test server read the request, not when it was sent: a
        request a worker sent just before its kill can be read after the kill is recorded
        (one was, 1 ms after), so a kill up to ``READ_LAG_SECONDS`` before it counts."""
        return any(start - READ_LAG_SECONDS <= at <= end for at in self.kills)


def attempts_outlasting(kills: int) -> int:
    """An attempt budget no run of random kills can use up: a step runs on one worker at a
    time (its lease), so each kill ends one of its attempts at most, and the random choice
    of victim can land on the same step every time (it did: a step of 50 was hit 5 times in
    10 kills). A step still poisoned past this budget is a defect the test must show."""
    return kills + 2


CHAOS_TASKS = 50
CHAOS_TOOL_STEPS = 5
# How long a held final answer waits for the killer at most (its worker's model timeout is
# longer): past it the run goes on, and the test fails on its count of kills, not a hang.
HOLD_LIMIT_SECONDS = 150.0
# Each kill costs the fleet a worker's start and its processes' first, cold steps: the number
# of kills, more than the work, sets how long the run takes.
CHAOS_KILLS = 10


def test_chaos_kills_lose_no_task_and_repeat_no_side_effect(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    # Every kill lands while tasks run: their final answers wait until the killer is done
    # (the run once outpaced it, when a worker's start got cheaper, and half the kills
    # landed on a fleet with nothing left to do). Kills so land in every part of a step, and,
    # at the end, in model calls waiting for their answers.
    kills_done = threading.Event()
    with WebhookReceiver(delay=0.1) as receiver:
        agent = PostingAgent(
            receiver, tool_steps=CHAOS_TOOL_STEPS, delay=0.03, hold_answers=kills_done
        )
        with OpenAIServer(responder=agent) as llm:
            # Each sweep re-sends every task overdue by the grace, lost or merely queued behind
            # the backlog; a longer grace re-sends fewer needlessly, and a dead worker's step,
            # long overdue, is still re-sent as soon as its lease ends.
            env = {**FAST, **model_env(llm), "RATCHET_SWEEP_GRACE_SECONDS": "3"}
            env["RATCHET_MODEL_TIMEOUT_SECONDS"] = str(HOLD_LIMIT_SECONDS + 30)
            env["RATCHET_MAX_STEP_ATTEMPTS"] = str(attempts_outlasting(CHAOS_KILLS))
            fleet = stack(workers=3, concurrency=2, env=env)
            with fleet.client(headers=tenant.headers) as http:
                bodies = {f"c{n}": posting_task(f"c{n}") for n in range(CHAOS_TASKS)}
                labels = submit_all(http, bodies)
                with Killer(fleet, every=2.0, limit=CHAOS_KILLS, done=kills_done) as killer:
                    tasks = wait_all(http, None, labels, timeout=HOLD_LIMIT_SECONDS + 60)
                timelines = {task_id: timeline(http, task_id) for task_id in labels}
            undelivered = llm.undelivered

    assert len(killer.kills) == CHAOS_KILLS, killer.kills
    check_chaos_run(
        tasks,
        labels,
        timelines,
        receiver=receiver,
        agent=agent,
        killer=killer,
        undelivered=undelivered,
        tool_steps=CHAOS_TOOL_STEPS,
    )


SLOW_TASKS = 500
SLOW_MODEL_SECONDS = 2.0
SLOW_KILLS = 3


def most_in_flight(asked: Mapping[tuple[str, int], list[Asked]], *, lasting: float) -> int:
    """The most model calls that were in flight at once, at least: each lasted ``lasting``."""
    arrivals = sorted(a.at for requests in asked.values() for a in requests)
    return max(
        bisect.bisect_right(arrivals, at) - bisect.bisect_left(arrivals, at - lasting + 0.001)
        for at in arrivals
    )


def test_chaos_with_hundreds_of_tasks_in_flight_on_a_slow_model(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    """Two worker processes, each running its steps on a pool of threads, keep hundreds of
    slow model calls in flight; killing a worker kills hundreds of steps at once, and every
    one of them resumes elsewhere: every task succeeds, no side effect twice."""
    with WebhookReceiver() as receiver:
        agent = PostingAgent(receiver, tool_steps=2, delay=SLOW_MODEL_SECONDS)
        with OpenAIServer(responder=agent) as llm:
            # A longer lease than the other crash tests: a busy 2-core machine must not starve
            # the heartbeats of 500 steps into losing a lease that no kill ended.
            env = {**FAST, **model_env(llm), "RATCHET_SWEEP_GRACE_SECONDS": "3"}
            env["RATCHET_LEASE_TTL_SECONDS"] = "8"
            env["RATCHET_MAX_STEP_ATTEMPTS"] = str(attempts_outlasting(SLOW_KILLS))
            fleet = stack(workers=2, concurrency=1, env=env)
            with fleet.client(headers=tenant.headers) as http:
                bodies = {f"s{n}": posting_task(f"s{n}") for n in range(SLOW_TASKS)}
                labels = submit_all(http, bodies)
                with Killer(fleet, every=6.0, limit=SLOW_KILLS) as killer:
                    tasks = wait_all(http, None, labels, timeout=240)
                timelines = {task_id: timeline(http, task_id) for task_id in labels}
            undelivered = llm.undelivered

    assert len(killer.kills) >= 1, killer.kills
    check_chaos_run(
        tasks,
        labels,
        timelines,
        receiver=receiver,
        agent=agent,
        killer=killer,
        undelivered=undelivered,
        tool_steps=2,
    )
    # Far more calls in flight at once than the fleet has processes (a step waiting on its
    # model holds a thread, not a process).
    assert most_in_flight(agent.asked(), lasting=SLOW_MODEL_SECONDS) >= 100


def check_chaos_run(
    tasks: Mapping[str, dict[str, Any]],
    labels: Mapping[str, str],
    timelines: Mapping[str, list[dict[str, Any]]],
    *,
    receiver: WebhookReceiver,
    agent: PostingAgent,
    killer: Killer,
    undelivered: set[float],
    tool_steps: int,
) -> None:
    """Every task succeeded; every side effect reached the receiver, more than once only
    across a kill (and then with the same key, counted by the ledger); every model call was
    made again only across a kill, and the answer committed is the last one asked for."""
    assert Counter(t["status"] for t in tasks.values()) == {"succeeded": len(labels)}, [
        t for t in tasks.values() if t["status"] != "succeeded"
    ]
    deliveries = receiver.by_header(KEY)
    expected_keys = set()
    for task_id, label in labels.items():
        steps = timelines[task_id]
        check_no_duplicates(task_id, steps, expected_steps=tool_steps + 1)
        for step in steps[:tool_steps]:
            [call] = step["tool_calls"]
            key = f"{task_id}:{step['number']}-0"
            expected_keys.add(key)
            assert (call["status"], call["idempotency_key"]) == ("succeeded", key), call
            seen = deliveries.get(key, [])
            assert seen, f"{key}: the receiver never saw the call the ledger says succeeded"
            sent = {"task": label, "step": step["number"]}
            # A kill can land mid-request: the receiver then saw the headers (the key) but
            # not the whole body. At least one request arrived whole, and none differs.
            assert all(sent_body(d) in (sent, None) for d in seen), seen
            assert any(sent_body(d) == sent for d in seen), seen
            # A repeat is a re-run after a kill, with the same key, and the ledger counts it.
            assert len(seen) <= call["runs"], (key, len(seen), call)
            for first, then in itertools.pairwise(seen):
                assert killer.killed_between(first.at, then.at), (key, seen, killer.kills)
    assert set(deliveries) == expected_keys, set(deliveries) - expected_keys

    asked = agent.asked()
    committed = {
        (labels[task_id], step["number"]): committed_reply(step)
        for task_id, steps in timelines.items()
        for step in steps
    }
    assert set(asked) == set(committed), set(asked) ^ set(committed)
    for task_step, requests in asked.items():
        # The committed answer is the last one asked for: nothing asked again after the commit …
        assert requests[-1].reply == committed[task_step], (requests, committed[task_step])
        # … and each earlier request was cut short before its answer was committed: by a
        # kill, or its answer never reached the worker (a connection that dropped), which a
        # worker may ask again for, as for any transient error of the model's.
        for before, again in itertools.pairwise(requests):
            lost = before.at in undelivered
            assert lost or killer.killed_between(before.at, again.at), (
                requests,
                killer.kills,
                sorted(undelivered),
            )
    repeats = sum(len(r) - 1 for r in asked.values())
    resent = sum(len(d) - 1 for d in deliveries.values())
    print(f"{len(killer.kills)} kills; {repeats} model calls and {resent} requests repeated")


# -- 2. kill points -----------------------------------------------------------------------------

# For each point: how many times the interrupted call reached the receiver and the runs the
# ledger counts for it; None when the kill is outside any tool call.
KILL_POINTS: dict[str, tuple[int, int] | None] = {
    "model_call": None,
    # The answer's commit also started its (idempotent) call: never sent, sent once on the re-run.
    "after_model_commit": (1, 2),
    "tool_call": (1, 2),  # started in the ledger, never sent: sent once, on the re-run
    "after_tool": (2, 2),  # sent, outcome lost: re-sent with the same key
    "after_step_commit": None,
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_kill_at_each_point_resumes_with_every_side_effect_once(
    point: str, stack: StackFactory, tenant: TenantHandle, tmp_path: Path
) -> None:
    with WebhookReceiver() as receiver:
        agent = PostingAgent(receiver, tool_steps=2)
        with OpenAIServer(responder=agent) as llm:
            kill = KillOnce.start(stack, point, marker=tmp_path / "killed", env=model_env(llm))
            with kill.fleet.client(headers=tenant.headers) as http:
                labels = submit_all(http, {f"k{n}": posting_task(f"k{n}") for n in range(2)})
                tasks = wait_all(http, None, labels, timeout=60)
                timelines = {task_id: timeline(http, task_id) for task_id in labels}

    kill.check_killed()
    for task_id, task in tasks.items():
        assert task["status"] == "succeeded", task
        assert task["result"]["output"].startswith(f"{labels[task_id]} done"), task
        check_no_duplicates(task_id, timelines[task_id], expected_steps=3)
    # The model was asked once per step: a kill before the call leaves nothing to repeat, a
    # kill after it finds the answer committed.
    assert {key: len(requests) for key, requests in agent.asked().items()} == {
        (label, step): 1 for label in labels.values() for step in (1, 2, 3)
    }
    deliveries = receiver.by_header(KEY)
    outcomes: Counter[tuple[int, int]] = Counter()
    for task_id, steps in timelines.items():
        for step in steps[:2]:
            [call] = step["tool_calls"]
            assert call["status"] == "succeeded", call
            seen = deliveries[call["idempotency_key"]]
            assert {d.headers[KEY] for d in seen} == {f"{task_id}:{step['number']}-0"}
            outcomes[(len(seen), call["runs"])] += 1
    interrupted = KILL_POINTS[point]
    expected = Counter({(1, 1): 4})
    if interrupted is not None:
        expected = Counter({(1, 1): 3, interrupted: 1})
    assert outcomes == expected


def test_kill_during_a_non_idempotent_tool_fails_with_unknown_outcome(
    stack: StackFactory, tenant: TenantHandle, tmp_path: Path
) -> None:
    journal = tmp_path / "journal"
    journal.touch()
    env = {"RATCHET_TEST_JOURNAL": str(journal)}
    kill = KillOnce.start(stack, "after_tool", marker=tmp_path / "killed", env=env)
    script = [tool_turn("send_email", to="a@example.com", subject="hi"), {"content": "sent"}]
    with kill.fleet.client(headers=tenant.headers) as http:
        [task_id] = submit_all(http, {"mail": scripted_task(script, agent="ops")})
        task = wait_all(http, None, [task_id], timeout=60)[task_id]
        [step] = timeline(http, task_id)

    kill.check_killed()
    assert task["status"] == "failed", task
    assert task["error"]["type"] == "tool_outcome_unknown", task
    assert "send_email" in task["error"]["message"]
    assert journal.read_text().splitlines() == [f"email {task_id}:1-0"]  # sent once, not again
    [call] = step["tool_calls"]
    assert (call["status"], call["runs"]) == ("failed", 1), call
    types = event_types(task_id)
    assert types.count("step.model_response") == 1
    assert types[-1] == "task.failed"


# -- 3. duplicate delivery ----------------------------------------------------------------------


@contextlib.contextmanager
def publisher(fleet: Stack) -> Iterator[Callable[[str, int], None]]:
    """Publish ``advance_task(task_id, step)`` messages on the stack's queue, as the API does."""
    from shared.constants import ADVANCE_TASK
    from shared.queue import configure
    from shared.settings import Settings

    settings = Settings(
        redis_url=fleet.env["RATCHET_REDIS_URL"],
        broker_url=fleet.env["RATCHET_BROKER_URL"],
        queue_name=fleet.env["RATCHET_QUEUE_NAME"],
    )
    app = Celery("ratchet-test-publisher", set_as_current=False)
    configure(app, settings)

    def publish(task_id: str, step: int) -> None:
        app.send_task(ADVANCE_TASK, args=[task_id, step], queue=settings.queue_name)

    try:
        yield publish
    finally:
        app.close()


def test_a_step_delivered_three_times_at_once_runs_once(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    with WebhookReceiver() as receiver:
        agent = PostingAgent(receiver, tool_steps=2, delay=0.5)
        with OpenAIServer(responder=agent) as llm:
            fleet = stack(workers=3, concurrency=1, env={**FAST, **model_env(llm)})
            with fleet.client(headers=tenant.headers) as http, publisher(fleet) as publish:
                labels: dict[str, str] = {}
                for n in range(2):
                    labels |= submit_all(http, {f"d{n}": posting_task(f"d{n}")})
                    task_id = next(reversed(labels))
                    publish(task_id, 1)  # the same message again, twice, while the first runs
                    publish(task_id, 1)
                tasks = wait_all(http, None, labels, timeout=60)
                timelines = {task_id: timeline(http, task_id) for task_id in labels}

    logs = all_logs(fleet)
    for task_id, task in tasks.items():
        assert task["status"] == "succeeded", task
        check_no_duplicates(task_id, timelines[task_id], expected_steps=3)
        # The copies reached other workers while the step ran, and were turned away there.
        assert re.search(rf"no lease for {task_id}: (held by another worker|lost the race)", logs)
    assert {key: len(requests) for key, requests in agent.asked().items()} == {
        (label, step): 1 for label in labels.values() for step in (1, 2, 3)
    }
    deliveries = receiver.by_header(KEY)
    assert sorted(deliveries) == sorted(f"{t}:{s}-0" for t in labels for s in (1, 2))
    assert all(len(seen) == 1 for seen in deliveries.values()), deliveries
    calls = [c for steps in timelines.values() for s in steps for c in s["tool_calls"]]
    assert {c["runs"] for c in calls} == {1}


def test_a_copy_delivered_during_the_last_allowed_attempt_is_turned_away(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    # One attempt allowed per step: the running one is the last. A copy of its message must
    # find the lease held, as any copy does; the step has not died, it is still running.
    fleet = stack(workers=2, concurrency=1, env={**FAST, "RATCHET_MAX_STEP_ATTEMPTS": "1"})
    with fleet.client(headers=tenant.headers) as http, publisher(fleet) as publish:
        script = [{"delay_ms": 2000, "content": "done"}]
        [task_id] = submit_all(http, {"last": scripted_task(script)})
        wait_for("a worker to lease the task", lambda: lease_of(task_id)[0] is not None)
        publish(task_id, 1)
        task = wait_all(http, None, [task_id], timeout=30)[task_id]

    assert task["status"] == "succeeded", task["error"]
    assert task["result"] == {"output": "done"}
    assert re.search(rf"no lease for {task_id}: held by another worker", all_logs(fleet))


# -- 4. a paused worker -------------------------------------------------------------------------


SWEEP_LOCK = "pg_try_advisory_xact_lock"

# Where a pause lands, as a predicate on (the paused worker's open statements, the task id).
# A step's writes (and the heartbeat) are single statements in autocommit: a worker never holds
# the task's row across a round trip, so no pause can land there (see the test after this).
PAUSES: dict[str, Callable[[list[str], str], bool]] = {
    # in its model call, between transactions
    "between_transactions": lambda statements, task_id: not statements,
    # in its sweeper's transaction, which holds the fleet's sweep lock
    "holding_the_sweep_lock": lambda statements, task_id: any(SWEEP_LOCK in s for s in statements),
}


def test_a_paused_worker_never_holds_the_task_row(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    """Freeze the only worker at random moments, a hundred times, while busy tasks run: the task's
    row is never locked while it is frozen, so a frozen worker cannot stall the worker that
    takes over."""
    fleet = stack(workers=1, concurrency=1, env=FAST)
    turns = [{"delay_ms": 300, **tool_turn("calculator", expression=f"{n}+1")} for n in range(15)]
    frozen = 0
    with fleet.client(headers=tenant.headers) as http:
        # A hundred freezes, over as many busy tasks as that takes (a busy machine makes each
        # freeze slow, so fewer fit in one task); each task must still succeed.
        while frozen < 100:
            [task_id] = submit_all(http, {"busy": scripted_task([*turns, {"content": "done"}])})
            wait_for("the worker to lease the task", partial(is_leased, task_id))
            while frozen < 100 and http.get(f"/v1/tasks/{task_id}").json()["status"] == "running":
                time.sleep(random.uniform(0, 0.005))
                fleet.kill_worker(0, signal.SIGSTOP)
                try:
                    held = held_while_frozen(task_id)
                    assert not held, f"a frozen worker holds the task's row: {holders()}"
                    frozen += 1
                finally:
                    fleet.kill_worker(0, signal.SIGCONT)
            task = wait_all(http, None, [task_id], timeout=60)[task_id]
            assert task["status"] == "succeeded", task["error"]


def is_leased(task_id: str) -> bool:
    return lease_of(task_id)[0] is not None


def held_while_frozen(task_id: str) -> bool:
    """Whether the frozen worker holds the task's row: a transaction of its own left open.

    A statement it sent just before it froze may still be running in the database (on a busy
    machine, for a while): that lock goes when the statement ends, so it is waited out, for
    less than the lease TTL (past which the database would end an idle transaction itself).
    A lock still there then counts only if a worker's transaction sits idle, open."""
    deadline = time.monotonic() + LEASE_TTL_SECONDS / 2
    while row_locked(task_id):
        if time.monotonic() > deadline:
            return workers_idle_in_transaction() > 0
        time.sleep(0.05)
    return False


def workers_idle_in_transaction() -> int:
    from shared.store.db import transaction

    with transaction() as session:
        count = session.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND state LIKE 'idle in transaction%' AND application_name = 'ratchet-worker'"
            )
        )
    return int(count or 0)


def pause_worker(
    fleet: Stack, index: int, *, task_id: str, where: str, epoch: int, within: float
) -> bool:
    """SIGSTOP worker ``index`` (its whole process group) at a moment that matches ``where``
    while it still holds ``task_id``'s lease ``epoch``, trying for ``within`` seconds; whether
    it did (a busy machine may not meet the moment before the step is over)."""
    pids = [fleet.worker_procs[index].pid, *fleet.worker_child_pids(index)]
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        fleet.kill_worker(index, signal.SIGSTOP)
        if PAUSES[where](open_transactions(pids), task_id) and lease_of(task_id)[1] == epoch:
            return True
        fleet.kill_worker(index, signal.SIGCONT)
        time.sleep(0.003)
    return False


@pytest.mark.parametrize("where", list(PAUSES))
def test_a_paused_worker_is_fenced_when_it_wakes(
    where: str, stack: StackFactory, tenant: TenantHandle
) -> None:
    fleet = stack(workers=2, concurrency=1, env=FAST)
    script = [{"delay_ms": 5000, **tool_turn("calculator", expression="6*7")}, {"content": "42"}]
    with fleet.client(headers=tenant.headers) as http:
        # The whole worker stops, as in a VM freeze: in the middle of the step's model call,
        # and perhaps in the middle of a transaction. Its lease runs out all the same, and
        # another worker must take the task over within a few lease periods. If the moment
        # is not met while the step's model call lasts, a new task gives it another chance.
        for attempt in range(5):
            [task_id] = submit_all(http, {f"paused-{attempt}": scripted_task(script)})
            wait_for("a worker to lease it", lambda t=task_id: lease_of(t)[0] is not None)
            owner, epoch = lease_of(task_id)
            assert owner is not None
            index = worker_of(fleet, owner_pid(owner))
            if pause_worker(fleet, index, task_id=task_id, where=where, epoch=epoch, within=4):
                break
            wait_all(http, None, [task_id], timeout=30)
        else:
            pytest.fail(f"could not pause a worker {where} during a step, in 5 tries")
        try:
            wait_for(
                "another worker to take the task over",
                lambda: lease_of(task_id)[1] > epoch,
                timeout=3 * LEASE_TTL_SECONDS,
            )
            task = wait_all(http, None, [task_id], timeout=30)[task_id]
        finally:
            fleet.kill_worker(index, signal.SIGCONT)
        assert task["status"] == "succeeded", task
        assert task["result"] == {"output": "42"}

        fenced = re.compile(rf"(fenced|LeaseLost).*{task_id}.*epoch {epoch}\b")
        label = f"worker-{index}"
        wait_for(
            "the woken worker to be fenced", lambda: bool(fenced.search(fleet.log_text(label)))
        )
        time.sleep(0.5)  # anything it might still write, it would have written by now
        steps = timeline(http, task_id)
        after = http.get(f"/v1/tasks/{task_id}").json()

    assert after == task  # the woken worker changed nothing
    check_no_duplicates(task_id, steps, expected_steps=2)
    [call] = steps[0]["tool_calls"]
    assert (call["status"], call["result"], call["runs"]) == ("succeeded", 42, 1)
    from shared.store.db import transaction
    from shared.store.tables import Step

    with transaction() as session:
        epochs = session.scalars(select(Step.lease_epoch).where(Step.task_id == task_id)).all()
    assert epoch not in epochs  # every step was written under a later lease


# -- 5. Redis flushed and restarted -------------------------------------------------------------


class RedisServer:
    """A redis-server of this test's own, on a free port, with nothing persisted."""

    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            if IN_CI:
                raise RuntimeError("redis-server is not installed")
            pytest.skip("redis-server is not installed")
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        with (self.directory / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, *args, "--dir", str(self.directory)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for("redis-server to answer", self._answers, timeout=10)

    def _answers(self) -> bool:
        assert self.proc is not None
        assert self.proc.poll() is None, (self.directory / "redis.log").read_text()
        try:
            with redis.Redis.from_url(self.url, socket_timeout=1) as conn:
                return bool(conn.ping())
        except redis.RedisError:
            return False

    def flushall(self) -> None:
        with redis.Redis.from_url(self.url) as conn:
            conn.flushall()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """Request it before ``stack``: the stack's teardown still talks to this Redis."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


def slow_steps(n: int, steps: int, delay_ms: int) -> list[dict[str, Any]]:
    turns = [
        {"delay_ms": delay_ms, **tool_turn("calculator", expression=f"{n}+{i}")}
        for i in range(1, steps)
    ]
    return [*turns, {"delay_ms": delay_ms, "content": f"task {n} done"}]


def test_redis_flushed_then_restarted_mid_run_loses_no_task(
    private_redis: RedisServer, stack: StackFactory, tenant: TenantHandle
) -> None:
    env = {**FAST, "RATCHET_REDIS_URL": private_redis.url, "RATCHET_BROKER_URL": private_redis.url}
    fleet = stack(workers=2, concurrency=2, env=env)
    with fleet.client(headers=tenant.headers) as http:
        bodies = {f"r{n}": scripted_task(slow_steps(n, 4, 300)) for n in range(16)}
        labels = submit_all(http, bodies)
        time.sleep(1.5)
        private_redis.flushall()  # every queued and unacked message is gone
        time.sleep(1.5)
        private_redis.kill()  # … and then the broker itself
        time.sleep(0.5)
        # Accepted while the broker is away: committed, its message never sent.
        labels |= submit_all(http, {"r16": scripted_task(slow_steps(16, 4, 300))})
        time.sleep(0.5)
        private_redis.start()  # back, empty
        tasks = wait_all(http, None, labels, timeout=90)
        timelines = {task_id: timeline(http, task_id) for task_id in labels}

    for task_id, task in tasks.items():
        n = int(labels[task_id][1:])
        assert task["status"] == "succeeded", task
        assert task["result"] == {"output": f"task {n} done"}
        check_no_duplicates(task_id, timelines[task_id], expected_steps=4)
    # What the flush took, the sweeper sent again, if anything needed it: steps that go on in
    # place on their worker need no message, and the task accepted while the broker was away
    # waited in the backlog for the dispatcher to admit it once the broker was back.
    swept = sum(int(n) for n in re.findall(r"sweeper re-enqueued (\d+)", all_logs(fleet)))
    print(f"the sweeper re-enqueued {swept} messages")


# -- 6. Postgres connections cut ----------------------------------------------------------------


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class Saboteur(abc.ABC):
    """A thread that does harm while its ``with`` block runs; what it raised, the block's end
    raises."""

    name = "saboteur"

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    @abc.abstractmethod
    def _run(self) -> None:
        """The harm, until ``_stop`` is set; it keeps what it raises in ``error``."""

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self.error is not None:
            raise self.error


class ConnectionCutter(Saboteur):
    """Cuts connections to the test database until the given tasks are all terminal, or for
    ``at_most`` seconds: every ``every`` seconds all of them, and in between, every ``sniping``
    seconds, those caught mid-query or mid-transaction. It watches the tasks on a connection of
    its own, which it spares."""

    name = "connection-cutter"
    ALL = "TRUE"
    BUSY = "state <> 'idle'"

    def __init__(
        self,
        database_url: str,
        task_ids: Iterable[str],
        *,
        every: float,
        sniping: float,
        at_most: float,
    ) -> None:
        super().__init__()
        self.url = _libpq(database_url)
        self.at_most = at_most
        self.task_ids = list(task_ids)
        self.every = every
        self.sniping = sniping
        self.rounds = 0
        self.terminated = Counter[str]()

    def _run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                next_round = time.monotonic() + self.every
                until = time.monotonic() + self.at_most
                while (
                    not self._stop.wait(self.sniping)
                    and time.monotonic() < until
                    and self._unfinished(conn)
                ):
                    if time.monotonic() >= next_round:
                        next_round += self.every
                        self.rounds += 1
                        self._cut(conn, self.ALL)
                    else:
                        self._cut(conn, self.BUSY)
        except BaseException as exc:
            self.error = exc

    def _unfinished(self, conn: psycopg.Connection[Any]) -> bool:
        row = conn.execute(
            "SELECT count(*) FROM tasks WHERE id = ANY(%s) AND status <> ALL(%s)",
            (self.task_ids, list(TERMINAL)),
        ).fetchone()
        return row is not None and row[0] > 0

    def _cut(self, conn: psycopg.Connection[Any], which: str) -> None:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid), state FROM pg_stat_activity "
            f"WHERE datname = current_database() AND pid <> pg_backend_pid() AND {which}"
        ).fetchall()
        self.terminated.update(state or "none" for done, state in rows if done)

    def wait(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"tasks unfinished after {timeout} s of cuts"


def test_postgres_connections_cut_mid_run_every_task_completes(
    stack: StackFactory, tenant: TenantHandle, database_url: str
) -> None:
    fleet = stack(workers=2, concurrency=2, env={**FAST, "RATCHET_MAX_STEP_ATTEMPTS": "50"})
    with fleet.client(headers=tenant.headers) as http:
        bodies = {f"p{n}": scripted_task(slow_steps(n, 4, 250)) for n in range(10)}
        labels = submit_all(http, bodies)
        # Writes are single statements now, in flight for a millisecond or so: snipe often. On
        # a busy machine the tasks may outlast the cuts: they must then finish after them.
        cuts = ConnectionCutter(database_url, labels, every=1.0, sniping=0.02, at_most=30.0)
        with cuts as cutter:
            cutter.wait(timeout=90)
        tasks = wait_all(http, None, labels, timeout=120)
        timelines = {task_id: timeline(http, task_id) for task_id in labels}

    errors = all_logs(fleet).count("OperationalError")
    print(f"{cutter.rounds} rounds; connections cut: {dict(cutter.terminated)}; {errors} errors")
    assert cutter.rounds >= 3, cutter.rounds
    # Some were cut in the middle of a query or a transaction, not only while idle in a pool.
    assert sum(n for state, n in cutter.terminated.items() if state != "idle") >= 5, (
        cutter.terminated
    )
    for task_id, task in tasks.items():
        n = int(labels[task_id][1:])
        assert task["status"] == "succeeded", task
        assert task["result"] == {"output": f"task {n} done"}
        check_no_duplicates(task_id, timelines[task_id], expected_steps=4)


# -- 7. a poison task ---------------------------------------------------------------------------


class LeaseKiller(Saboteur):
    """SIGKILLs whichever of the fleet's processes holds the task's lease, once per epoch."""

    name = "lease-killer"

    def __init__(self, fleet: Stack, task_id: str) -> None:
        super().__init__()
        self.fleet = fleet
        self.task_id = task_id
        self.killed: list[int] = []  # the pids

    def _run(self) -> None:
        seen_epoch = 0
        try:
            while not self._stop.wait(0.05):
                owner, epoch = lease_of(self.task_id)
                if owner is None or epoch <= seen_epoch:
                    continue
                seen_epoch, pid = epoch, owner_pid(owner)
                assert pid in pool_pids(self.fleet), f"{owner} is none of this fleet's processes"
                os.kill(pid, signal.SIGKILL)
                self.killed.append(pid)
        except BaseException as exc:
            self.error = exc


def test_a_task_that_kills_every_worker_fails_with_worker_lost(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    attempts = 3
    fleet = stack(
        workers=2, concurrency=1, env={**FAST, "RATCHET_MAX_STEP_ATTEMPTS": str(attempts)}
    )
    with fleet.client(headers=tenant.headers) as http:
        [poison] = submit_all(http, {"poison": scripted_task([{"delay_ms": 1500, "content": "x"}])})
        with LeaseKiller(fleet, poison) as killer:
            bodies = {f"ok{n}": scripted_task(slow_steps(n, 3, 100)) for n in range(8)}
            labels = submit_all(http, bodies)
            tasks = wait_all(http, None, [poison, *labels], timeout=60)
        timelines = {task_id: timeline(http, task_id) for task_id in labels}

    failed = tasks.pop(poison)
    assert failed["status"] == "failed", failed
    assert failed["error"]["type"] == "worker_lost", failed
    assert f"{attempts} attempts" in failed["error"]["message"], failed
    # Each attempt ran until it was killed: none was cut short by the task failing under it.
    assert len(killer.killed) == attempts, killer.killed
    types = event_types(poison)
    assert "step.model_response" not in types
    assert types[-1] == "task.failed"
    # The other tasks went on. A process that dies takes every step in flight in it, and each
    # of those steps loses an attempt too: a task whose step shared the poison's process at
    # every one of its attempts fails the same way. None is lost, stuck or run twice.
    statuses = Counter(task["status"] for task in tasks.values())
    assert statuses["succeeded"] >= 1, tasks
    for task_id, task in tasks.items():
        n = int(labels[task_id][2:])
        if task["status"] == "failed":
            assert task["error"]["type"] == "worker_lost", task
            continue
        assert task["status"] == "succeeded", task
        assert task["result"] == {"output": f"task {n} done"}
        check_no_duplicates(task_id, timelines[task_id], expected_steps=3)
