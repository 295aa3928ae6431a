"""DESIGN §6 against real processes: webhooks, the event stream and the long poll.

``ratchet api`` and ``ratchet worker`` processes run on this run's Postgres and Redis, with a
compressed retry schedule (four attempts, 0.2 s apart) and a fast sweeper. Webhooks land in a
receiver in this process and are checked the way a receiver would check them, with the
``standardwebhooks`` package. The tests that do not kill anything share one stack; the ones
that do start their own. The last test runs the embedded default, ``ratchet dev``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from standardwebhooks.webhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError as ReferenceVerificationError

from ratchet.client import Client, WebhookVerificationError, verify_webhook
from tests.conftest import TenantHandle
from tests.e2e.conftest import Stack, StackFactory, free_port, logs_on_failure, running_stack
from tests.e2e.util import wait_all
from tests.fakes.receiver import WebhookReceiver
from tests.helpers import TERMINAL, scripted_task, tool_turn

RETRY_SCHEDULE = [0, 0.2, 0.2, 0.2]
FAST = {
    "RATCHET_WEBHOOK_RETRY_SCHEDULE": ",".join(map(str, RETRY_SCHEDULE)),
    "RATCHET_SWEEP_INTERVAL_SECONDS": "0.5",
    "RATCHET_SWEEP_GRACE_SECONDS": "1",
    "RATCHET_SHUTDOWN_GRACE_SECONDS": "0",
}
TERMINAL_EVENTS = ("task.succeeded", "task.failed", "task.cancelled")
STEP_DELAY_MS = 250
SLOW_STEPS = 4
# queued, started; per tool step: model response, tool call, completed; then the final step's
# model response and completion, and the terminal event.
SLOW_TASK_EVENTS = [
    "task.queued",
    "task.started",
    *["step.model_response", "step.tool_call", "step.completed"] * (SLOW_STEPS - 1),
    "step.model_response",
    "step.completed",
    "task.succeeded",
]


# -- tasks and their deliveries ----------------------------------------------------------------


def slow_task(steps: int = SLOW_STEPS, **extra: Any) -> dict[str, Any]:
    """Calculator steps and a final answer, each model call taking ``STEP_DELAY_MS``."""
    turns = [tool_turn("calculator", expression=f"{i}*7") for i in range(1, steps)]
    turns.append({"content": f"done after {steps - 1} calculations"})
    return scripted_task([{**turn, "delay_ms": STEP_DELAY_MS} for turn in turns], **extra)


def quick_task(text: str = "done", **extra: Any) -> dict[str, Any]:
    return scripted_task([{"content": text}], **extra)


def submit(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post("/v1/tasks", json=body)
    assert response.status_code == 202, response.text
    task: dict[str, Any] = response.json()
    return task


def deliveries(http: httpx.Client, task_id: str) -> list[dict[str, Any]]:
    response = http.get(f"/v1/tasks/{task_id}/webhook-deliveries")
    assert response.status_code == 200, response.text
    items: list[dict[str, Any]] = response.json()["items"]
    return items


def wait_for_delivery(
    http: httpx.Client, task_id: str, status: str, timeout: float = 20.0
) -> dict[str, Any]:
    """Poll the API until the task's one delivery has ``status``; return it."""
    deadline = time.monotonic() + timeout
    listed: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        listed = deliveries(http, task_id)
        if len(listed) == 1 and listed[0]["status"] == status:
            return listed[0]
        time.sleep(0.1)
    raise AssertionError(f"no {status} delivery after {timeout} s: {listed}")


def current_secret(tenant: TenantHandle) -> str:
    from shared.store.db import transaction
    from shared.webhooks import secrets as webhook_secrets

    with transaction() as session:
        return webhook_secrets.current(session, tenant.id)


def ratchet(*args: str, cwd: Path) -> str:
    """Run the ``ratchet`` command with this run's settings; return its stdout, stripped."""
    command = shutil.which("ratchet", path=str(Path(sys.executable).parent)) or "ratchet"
    done = subprocess.run(
        [command, *args],
        check=False,
        cwd=cwd,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"ratchet {' '.join(args)}: {done.stderr}"
    return done.stdout.strip()


# -- server-sent events, read raw ---------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    id: str  # a committed event's seq, or a live delta's <seq>.<pos>
    type: str
    data: dict[str, Any]

    @property
    def seq(self) -> int:
        """The committed event's seq (a delta's: the event it follows)."""
        return int(self.id.partition(".")[0])

    @property
    def live(self) -> bool:
        return self.type.startswith("message.")


def sse_events(response: httpx.Response) -> Iterator[Event]:
    """Events as they arrive on an open stream (comments such as keep-alives skipped)."""
    fields: dict[str, str] = {}
    for line in response.iter_lines():
        if not line:
            if fields:
                yield Event(fields["id"], fields["event"], json.loads(fields["data"]))
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")


@dataclass
class PiecewiseRead:
    events: list[Event]
    connections: int
    tail_after_terminal: list[Event]
    running_at_first_disconnect: bool


def read_in_pieces(
    base_url: str, headers: dict[str, str], task_id: str, *, per_connection: int = 2
) -> PiecewiseRead:
    """Follow a task's stream, hanging up after every ``per_connection`` events and coming
    back with ``Last-Event-ID``; on the connection that brings the terminal event, read on
    until the server ends the stream."""
    events: list[Event] = []
    connections = 0
    running_at_first_disconnect = False
    timeout = httpx.Timeout(10.0, read=5.0)  # a stream that does not end fails the read
    with httpx.Client(base_url=base_url, headers=headers, timeout=timeout) as http:
        while True:
            connections += 1
            resume = {"Last-Event-ID": events[-1].id} if events else {}
            with http.stream("GET", f"/v1/tasks/{task_id}/events", headers=resume) as response:
                assert response.status_code == 200, response.read()
                stream = sse_events(response)
                for count, event in enumerate(stream, start=1):
                    events.append(event)
                    if event.type in TERMINAL_EVENTS:
                        tail = list(stream)
                        return PiecewiseRead(events, connections, tail, running_at_first_disconnect)
                    if count == per_connection:
                        break  # leaving the block drops the connection mid-stream
                else:
                    raise AssertionError(f"the stream ended before a terminal event: {events}")
            if connections == 1:
                status = http.get(f"/v1/tasks/{task_id}").json()["status"]
                running_at_first_disconnect = status not in TERMINAL


def assert_whole_log(read: PiecewiseRead, expected_types: list[str]) -> None:
    """The committed log whole and in order, and no live delta twice (a resume after a delta's
    id goes on after it)."""
    committed = [e for e in read.events if not e.live]
    assert [e.type for e in committed] == expected_types
    assert [e.seq for e in committed] == list(range(1, len(expected_types) + 1))
    ids = [e.id for e in read.events]
    assert len(ids) == len(set(ids))
    assert read.tail_after_terminal == []
    assert read.connections >= len(expected_types) // 2
    assert read.running_at_first_disconnect, "the task ended before the first reconnect"


# -- a TCP proxy that cuts event streams short ----------------------------------------------------


class CuttingProxy:
    """A TCP proxy in front of the API that cuts every event stream: it passes the response
    head and ``events`` events, then a few bytes of the next one, and drops the connection.

    Other responses pass untouched; give a stream a client of its own, since only the first
    response on a connection is looked at.
    """

    PARTIAL_BYTES = 12

    def __init__(self, upstream: str, *, events: int = 2) -> None:
        parsed = httpx.URL(upstream)
        self._upstream = (parsed.host, parsed.port or 80)
        self._events = events
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.cuts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self._upstream)
        with self._lock:
            self._sockets += [client, upstream]
        threading.Thread(target=_pump, args=(client, upstream), daemon=True).start()
        seen, sent, cut_at = b"", 0, None
        try:
            while data := upstream.recv(65536):
                seen += data
                cut_at = cut_at or self._cut_point(seen)
                limit = min(len(seen), cut_at) if cut_at else len(seen)
                client.sendall(seen[sent:limit])
                sent = limit
                if cut_at and sent >= cut_at:
                    with self._lock:
                        self.cuts += 1
                    return
        except OSError:
            return
        finally:
            _close(client, upstream)

    def _cut_point(self, seen: bytes) -> int | None:
        head_end = seen.find(b"\r\n\r\n")
        if head_end < 0 or b"text/event-stream" not in seen[:head_end].lower():
            return None
        position = head_end + 4
        for _ in range(self._events):
            found = seen.find(b"\n\n", position)
            if found < 0:
                return None
            position = found + 2
        return position + self.PARTIAL_BYTES

    def __enter__(self) -> CuttingProxy:
        threading.Thread(target=self._serve, name="cutting-proxy", daemon=True).start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._listener.close()
        with self._lock:
            _close(*self._sockets)


def _pump(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            target.sendall(data)
    except OSError:
        pass
    finally:
        _close(source, target)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


# -- a Redis in front of the real one that catches a worker right after a terminal commit --------


def task_status(task_id: str) -> str | None:
    from shared.store.db import transaction
    from shared.store.tables import Task

    with transaction() as session:
        return session.scalar(select(Task.status).where(Task.id == task_id))


def delivery_states(task_id: str) -> list[tuple[str, str, int]]:
    from shared.store.db import transaction
    from shared.store.tables import WebhookDelivery

    with transaction() as session:
        rows = session.execute(
            select(WebhookDelivery.event_type, WebhookDelivery.status, WebhookDelivery.attempts)
            .where(WebhookDelivery.task_id == task_id)
            .order_by(WebhookDelivery.event_seq)
        ).all()
    return [(r.event_type, r.status, r.attempts) for r in rows]


# -- the shared stack ---------------------------------------------------------------------------


@pytest.fixture(scope="class")
def class_stack(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """One API and two workers for every test of the class (none of them kills a process)."""
    log_dir = tmp_path_factory.mktemp("fleet")
    with running_stack(
        service_env, log_dir, queue="delivery", env=FAST, workers=2, concurrency=2
    ) as started:
        yield started


@pytest.fixture
def shared_fleet(class_stack: Stack, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """The class's stack; when a test fails, the tail of each process's log is printed."""
    yield from logs_on_failure(class_stack, request)


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as started:
        yield started


class TestOneStack:
    def test_a_failing_receiver_gets_the_same_message_until_it_accepts_it(
        self, shared_fleet: Stack, tenant: TenantHandle, receiver: WebhookReceiver
    ) -> None:
        receiver.respond("/flaky", 500, 500, 500)
        with shared_fleet.client(headers=tenant.headers) as http:
            task = submit(http, quick_task(webhook={"url": receiver.url("/flaky")}))
            attempts = receiver.wait_for(4, path="/flaky")
            listed = wait_for_delivery(http, task["id"], "delivered")

        assert [a.answered for a in attempts] == [500, 500, 500, 200]
        assert {a.webhook_id for a in attempts} == {listed["webhook_id"]}
        assert {a.body for a in attempts} == {attempts[0].body}
        secret = current_secret(tenant)
        for attempt in attempts:  # each attempt is signed afresh
            payload = Webhook(secret).verify(attempt.body, dict(attempt.headers))
            assert payload["data"]["id"] == task["id"]
        gaps = [later.at - earlier.at for earlier, later in itertools.pairwise(attempts)]
        assert all(gap >= 0.8 * 0.2 - 0.02 for gap in gaps), gaps  # the schedule, with jitter
        log = listed["attempts"]
        assert [a["number"] for a in log] == [1, 2, 3, 4]
        assert [a["status_code"] for a in log] == [500, 500, 500, 200]
        assert all("500" in a["error"] for a in log[:3]), log
        assert log[3]["error"] is None
        assert all(isinstance(a["latency_ms"], int) and a["latency_ms"] >= 0 for a in log)
        assert listed["delivered_at"] is not None
        assert listed["next_attempt_at_ms"] is None

    def test_a_receiver_down_for_the_whole_schedule_fails_and_a_redelivery_succeeds(
        self, shared_fleet: Stack, tenant: TenantHandle, make_tenant: Callable[..., TenantHandle]
    ) -> None:
        with (
            WebhookReceiver(down=True) as receiver,
            shared_fleet.client(headers=tenant.headers) as http,
        ):
            task = submit(http, quick_task(webhook={"url": receiver.url("/down")}))
            failed = wait_for_delivery(http, task["id"], "failed")

            assert len(failed["attempts"]) == len(RETRY_SCHEDULE)
            for attempt in failed["attempts"]:
                assert attempt["status_code"] is None
                assert "ConnectError" in attempt["error"], attempt
            assert failed["next_attempt_at_ms"] is None

            other = make_tenant()
            forbidden = http.post(
                f"/v1/webhook-deliveries/{failed['id']}/redeliver", headers=other.headers
            )
            assert forbidden.status_code == 404

            receiver.up()
            response = http.post(f"/v1/webhook-deliveries/{failed['id']}/redeliver")
            assert response.status_code == 202, response.text
            assert response.json()["status"] == "pending"
            delivered = wait_for_delivery(http, task["id"], "delivered")
            [request] = receiver.wait_for(1)

        assert request.webhook_id == failed["webhook_id"]
        log = delivered["attempts"]
        assert [a["number"] for a in log] == [1, 2, 3, 4, 5]
        assert [a["status_code"] for a in log] == [None, None, None, None, 200]
        assert Webhook(current_secret(tenant)).verify(request.body, dict(request.headers))

    def test_two_hundred_tasks_two_hundred_webhooks_each_to_its_own_tenant(
        self,
        shared_fleet: Stack,
        make_tenant: Callable[..., TenantHandle],
        receiver: WebhookReceiver,
        tmp_path: Path,
    ) -> None:
        per_tenant = 100
        a, b = make_tenant(), make_tenant()
        # Tenant a names its webhook on each task; tenant b has a default endpoint.
        ratchet(
            "webhooks",
            "add-endpoint",
            "--tenant",
            b.name,
            "--url",
            receiver.url("/b"),
            cwd=tmp_path,
        )
        bodies = {
            "/a": quick_task(webhook={"url": receiver.url("/a")}),
            "/b": quick_task(),
        }
        owners = {"/a": a, "/b": b}
        tasks: dict[str, set[str]] = {"/a": set(), "/b": set()}
        with shared_fleet.client() as http:
            for n in range(per_tenant):
                for path, owner in owners.items():
                    response = http.post(
                        "/v1/tasks",
                        json={**bodies[path], "metadata": {"n": n}},
                        headers=owner.headers,
                    )
                    assert response.status_code == 202, response.text
                    tasks[path].add(response.json()["id"])
            for path, owner in owners.items():
                done = wait_all(http, owner.headers, tasks[path], timeout=90)
                assert {t["status"] for t in done.values()} == {"succeeded"}

        receiver.wait_for(2 * per_tenant, timeout=60)
        time.sleep(1.5)  # a few sweeps more: a duplicate would show up now

        secrets = {path: current_secret(owner) for path, owner in owners.items()}
        assert Counter(r.path for r in receiver.received()) == {"/a": per_tenant, "/b": per_tenant}
        for path, other in (("/a", "/b"), ("/b", "/a")):
            received = receiver.received(path)
            ids = Counter(r.webhook_id for r in received)
            assert max(ids.values()) == 1, ids.most_common(3)
            payloads = [Webhook(secrets[path]).verify(r.body, dict(r.headers)) for r in received]
            assert {p["data"]["id"] for p in payloads} == tasks[path]
            assert {p["type"] for p in payloads} == {"task.succeeded"}
            for request in received[:5]:
                with pytest.raises(ReferenceVerificationError):
                    Webhook(secrets[other]).verify(request.body, dict(request.headers))
        for path in owners:
            states = [s for task_id in tasks[path] for s in delivery_states(task_id)]
            assert states == [("task.succeeded", "delivered", 1)] * per_tenant

    def test_after_an_endpoint_answers_410_no_worker_sends_to_it_again(
        self,
        shared_fleet: Stack,
        tenant: TenantHandle,
        receiver: WebhookReceiver,
        tmp_path: Path,
    ) -> None:
        ratchet(
            "webhooks",
            "add-endpoint",
            "--tenant",
            tenant.name,
            "--url",
            receiver.url("/endpoint"),
            cwd=tmp_path,
        )
        with shared_fleet.client(headers=tenant.headers) as http:
            # Every worker process runs some of these and so has the endpoint in mind.
            warm = [submit(http, quick_task())["id"] for _ in range(8)]
            wait_all(http, None, warm, timeout=30)
            receiver.wait_for(len(warm), path="/endpoint")
            receiver.respond("/endpoint", then=410)
            gone = submit(http, quick_task())
            wait_for_delivery(http, gone["id"], "disabled")

            later = [submit(http, quick_task())["id"] for _ in range(8)]
            wait_all(http, None, later, timeout=30)
            time.sleep(1.0)  # time for any delivery they queued to go out
            states = [s for task_id in later for s in delivery_states(task_id)]

        answered = [r.answered for r in receiver.received("/endpoint")]
        assert answered == [200] * len(warm) + [410], (
            f"sent again after the endpoint answered 410 and was disabled: {answered}; "
            f"deliveries of the later tasks: {states}"
        )
        assert all(status == "disabled" for _, status, _ in states), states

    def test_an_sse_reader_that_hangs_up_every_two_events_gets_each_event_once(
        self, shared_fleet: Stack, tenant: TenantHandle
    ) -> None:
        with shared_fleet.client(headers=tenant.headers) as http:
            task = submit(http, slow_task())

        read = read_in_pieces(shared_fleet.url, tenant.headers, task["id"])

        assert_whole_log(read, SLOW_TASK_EVENTS)
        assert read.events[-1].data["id"] == task["id"]
        assert read.events[-1].data["status"] == "succeeded"

    def test_a_finished_tasks_stream_replays_resumes_and_ends(
        self, shared_fleet: Stack, tenant: TenantHandle, make_tenant: Callable[..., TenantHandle]
    ) -> None:
        with shared_fleet.client(headers=tenant.headers) as http:
            task = submit(http, slow_task(steps=2))
            wait_all(http, None, [task["id"]], timeout=30)
            path = f"/v1/tasks/{task['id']}/events"

            with http.stream("GET", path) as response:
                everything = list(sse_events(response))
            with http.stream("GET", path, params={"after": 3}) as response:
                after_three = list(sse_events(response))
            started = time.monotonic()
            last = str(everything[-1].seq)
            with http.stream("GET", path, headers={"Last-Event-ID": last}) as response:
                assert response.status_code == 200
                after_the_end = list(sse_events(response))
            resumed_in = time.monotonic() - started
            hidden = http.get(path, headers=make_tenant().headers)

        assert [e.seq for e in everything] == list(range(1, len(everything) + 1))
        assert everything[-1].type == "task.succeeded"
        assert after_three == everything[3:]
        assert after_the_end == []
        assert resumed_in < 1.0
        assert hidden.status_code == 404
        assert hidden.headers["content-type"].startswith("application/problem+json")

    def test_a_long_poll_answers_within_a_second_of_the_task_ending(
        self, shared_fleet: Stack, tenant: TenantHandle
    ) -> None:
        # It ends about 2.4 s in: a poll that only looked every 2 s would answer 1.6 s late.
        body = scripted_task([{"content": "slow answer", "delay_ms": 2300}])
        with shared_fleet.client(headers=tenant.headers) as http:
            task = submit(http, body)
            asked = time.time()
            response = http.get(f"/v1/tasks/{task['id']}", params={"wait": 10}, timeout=20)
            answered = time.time()

        assert response.status_code == 200
        done = response.json()
        assert done["status"] == "succeeded"
        finished = datetime.fromisoformat(done["finished_at"]).timestamp()
        assert asked < finished
        assert answered - finished < 1.0, f"answered {answered - finished:.2f} s after the end"
        assert answered - asked < 10.0

    def test_the_python_client_waits_follows_and_verifies(
        self, shared_fleet: Stack, tenant: TenantHandle, receiver: WebhookReceiver
    ) -> None:
        with Client(shared_fleet.url, tenant.key) as client:
            task = client.submit(slow_task(webhook={"url": receiver.url("/client")}))
            done = client.wait(task["id"], timeout=30)
            followed = client.submit(slow_task())

        assert done["id"] == task["id"]
        assert done["status"] == "succeeded"
        assert done["result"] == {"output": f"done after {SLOW_STEPS - 1} calculations"}

        with CuttingProxy(shared_fleet.url, events=2) as proxy:
            with Client(proxy.url, tenant.key) as client:
                events = list(client.events(followed["id"]))
            cuts = proxy.cuts

        assert [e.type for e in events] == SLOW_TASK_EVENTS
        assert [e.seq for e in events] == list(range(1, len(SLOW_TASK_EVENTS) + 1))
        assert cuts >= 2

        [request] = receiver.wait_for(1, path="/client")
        secret = current_secret(tenant)
        payload = verify_webhook(secret, request.headers, request.body)
        assert payload["data"]["id"] == task["id"]
        tampered = request.body.replace(b'"succeeded"', b'"failed"', 1)
        with pytest.raises(WebhookVerificationError):
            verify_webhook(secret, request.headers, tampered)


# -- a worker killed between the terminal commit and the webhook ---------------------------------


def test_a_worker_killed_right_after_the_terminal_commit_still_gets_the_webhook_sent(
    stack: StackFactory, tenant: TenantHandle, receiver: WebhookReceiver
) -> None:
    fleet = stack(workers=0, env=FAST)
    sweeps = fleet.env["RATCHET_SWEEP_INTERVAL_SECONDS"]
    # The doomed worker kills itself once the task's terminal commit is done and before it
    # hands that commit's webhook to its sender; it never sweeps.
    fleet.env.update(
        {"RATCHET_FAILPOINTS": "before_webhooks=kill", "RATCHET_SWEEP_INTERVAL_SECONDS": "3600"}
    )
    doomed = fleet.start_worker(concurrency=1)
    del fleet.env["RATCHET_FAILPOINTS"]
    fleet.env["RATCHET_SWEEP_INTERVAL_SECONDS"] = sweeps
    with fleet.client(headers=tenant.headers) as http:
        task = submit(http, quick_task(webhook={"url": receiver.url("/after-crash")}))
        deadline = time.monotonic() + 30
        while task_status(task["id"]) != "succeeded" and time.monotonic() < deadline:
            time.sleep(0.05)
        fleet.kill_worker(doomed)  # the rest of it, lest its pool start another process

        assert task_status(task["id"]) == "succeeded"
        assert delivery_states(task["id"]) == [("task.succeeded", "pending", 0)]
        time.sleep(0.5)
        assert receiver.received() == []  # the send it was about to make is lost

        fleet.start_worker()  # its sweeper finds the pending delivery
        [request] = receiver.wait_for(1, timeout=20)
        listed = wait_for_delivery(http, task["id"], "delivered")
        time.sleep(1.0)  # a duplicate would show up now

    assert len(receiver.received()) == 1
    assert request.webhook_id == listed["webhook_id"]
    assert [a["status_code"] for a in listed["attempts"]] == [200]
    payload = Webhook(current_secret(tenant)).verify(request.body, dict(request.headers))
    assert payload["type"] == "task.succeeded"
    assert payload["data"]["id"] == task["id"]


# -- the embedded default -----------------------------------------------------------------------

DEV_READY = re.compile(r"export RATCHET_URL=(?P<url>\S+) RATCHET_KEY=(?P<key>\S+)")


@dataclass(frozen=True)
class DevServer:
    url: str
    key: str


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_until_serving(proc: subprocess.Popen[bytes], out: Path) -> DevServer:
    deadline = time.monotonic() + 60
    while True:
        found = DEV_READY.search(out.read_text())
        if found and _answers(found["url"]):
            return DevServer(found["url"], found["key"])
        assert proc.poll() is None, f"ratchet dev exited:\n{out.read_text()}"
        assert time.monotonic() < deadline, f"ratchet dev did not start:\n{out.read_text()}"
        time.sleep(0.1)


@pytest.fixture
def dev_server(tmp_path: Path) -> Iterator[DevServer]:
    """``ratchet dev`` in an empty directory (SQLite, in-process queue), with no RATCHET_*
    setting in its environment, so neither Postgres nor Redis is involved."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env["PYTHONUNBUFFERED"] = "1"
    command = shutil.which("ratchet", path=str(Path(sys.executable).parent)) or "ratchet"
    out = tmp_path / "dev.log"
    with out.open("wb") as log:
        proc = subprocess.Popen(
            [command, "dev", "--port", str(free_port())],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield _wait_until_serving(proc, out)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def test_the_embedded_default_streams_a_tasks_events_to_the_end(dev_server: DevServer) -> None:
    headers = {"Authorization": f"Bearer {dev_server.key}"}
    with httpx.Client(base_url=dev_server.url, headers=headers, timeout=30) as http:
        task = submit(http, slow_task())

    read = read_in_pieces(dev_server.url, headers, task["id"])

    assert_whole_log(read, SLOW_TASK_EVENTS)
    assert read.events[-1].data["status"] == "succeeded"
