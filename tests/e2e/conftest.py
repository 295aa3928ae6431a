"""The real thing: ``ratchet api`` and ``ratchet worker`` processes, talked to over HTTP.

``stack(workers=2, concurrency=1, env=None)`` starts one API (uvicorn, on a free port) and
``workers`` Celery workers (prefork pool, ``concurrency`` children each) as subprocesses, with
this run's database and Redis (``service_env``) plus ``env`` overrides, and returns a
:class:`Stack` once ``GET /readyz`` answers 200 and every worker has logged that it is ready::

    def test_something(stack, tenant):
        fleet = stack(workers=2, env={"RATCHET_LEASE_TTL_SECONDS": "3"})
        with fleet.client(headers=tenant.headers) as http:
            task = http.post("/v1/tasks", json=...).json()
        fleet.kill_worker(0)                       # SIGKILL to its whole process group
        fleet.kill_worker(1, signal.SIGSTOP)       # ... or pause it (SIGCONT resumes)
        fleet.start_worker()                       # a fresh one, index 2

Each stack gets a Celery queue of its own, so leftovers of an earlier test never reach its
workers. Every process runs in a session of its own (its own process group), logs to a file
of its own, and is stopped at teardown: SIGTERM to the leader (with SIGCONT to the group, as
a stopped process cannot act on SIGTERM), then SIGKILL to the whole group, so no process and
no prefork child is left behind. When a test fails, the tail of every log is printed with it.

A module whose tests stop no process shares one stack, made by :func:`module_stack_fixture`::

    module_stack = module_stack_fixture("approvals")   # queue suffix, log folder

    def test_something(fleet, client, ratchet, user):  # fixtures of this file, on that stack
        task = client.submit(...)                     # ratchet.client.Client with the tenant's key
        result = ratchet("tail", task["id"], env=user)  # python -m ratchet, as a person would
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from benchmarks.harness.processes import free_port
from ratchet.client import Client
from tests.conftest import TenantHandle
from tests.e2e.util import DatabaseProxy, Terminal

# Only a bound against a hang: a process that starts is waited for, however loaded the machine
# (an API of several processes once took over 60 s to come up beside two other suites).
START_TIMEOUT_SECONDS = 180.0
STOP_TIMEOUT_SECONDS = 10.0
LOG_TAIL_LINES = 200
ROOT = Path(__file__).resolve().parents[2]
REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()
# Short leases and a fast sweeper, so that a killed worker's step is taken over within seconds;
# at teardown, delayed retries are requeued at once instead of waited for.
FAST_RECOVERY = {
    "RATCHET_LEASE_TTL_SECONDS": "2",
    "RATCHET_SWEEP_INTERVAL_SECONDS": "0.5",
    "RATCHET_SWEEP_GRACE_SECONDS": "1",
    "RATCHET_SHUTDOWN_GRACE_SECONDS": "0",
}


# Every process a stack starts carries the pid of the test runner that started it. A runner cut
# off (killed by a timeout, a closed terminal) leaves its stacks running, busy with their
# tasks and loading the machine for whatever runs next (one ran for an hour): the first stack
# of every later run stops them.
RUNNER = "RATCHET_TEST_STACK_RUNNER"


_orphans_stopped: list[bool] = []


class StackError(Exception):
    """A process of the stack did not start."""


def _ratchet_command() -> str:
    # The console script next to this interpreter first: the venv need not be on PATH.
    found = shutil.which("ratchet", path=str(Path(sys.executable).parent)) or shutil.which(
        "ratchet"
    )
    if found is None:
        raise StackError("the `ratchet` command is not installed (pip install -e .)")
    return found


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a process group; a group that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def orphaned_stack_groups() -> set[int]:
    """The process groups of stack processes whose test runner is gone."""
    groups = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # exited while we looked, or not ours to read
        runner = next((v for v in environ if v.startswith(f"{RUNNER}=".encode())), None)
        if runner is None:
            continue
        pid = runner.partition(b"=")[2].decode()
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                groups.add(os.getpgid(int(entry.name)))
    return groups


def stop_orphaned_stacks() -> None:
    """SIGKILL (after SIGCONT, for a paused one) every stack whose runner is gone."""
    for group in orphaned_stack_groups():
        signal_group(group, signal.SIGCONT)
        signal_group(group, signal.SIGKILL)


def child_pids(pid: int) -> list[int]:
    """Live (non-zombie) children of ``pid``, read from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # The command name may hold spaces and parentheses: the fields start after the last ")".
        state, parent = stat.rpartition(")")[2].split()[:2]
        if int(parent) == pid and state != "Z":
            children.append(int(entry.name))
    return sorted(children)


class Stack:
    """A running API and its workers. Create it with the ``stack`` fixture."""

    def __init__(
        self, *, env: Mapping[str, str], log_dir: Path, concurrency: int, api_workers: int = 1
    ) -> None:
        self.env = {**env, RUNNER: str(os.getpid())}
        self.log_dir = log_dir
        self.concurrency = concurrency
        self.api_workers = api_workers
        self.url = ""
        self.api_proc: subprocess.Popen[bytes] | None = None
        self.worker_procs: list[subprocess.Popen[bytes]] = []
        self.worker_names: list[str] = []
        self._token = uuid.uuid4().hex[:8]
        self._command = _ratchet_command()
        self._clients: list[httpx.Client] = []

    # -- starting -------------------------------------------------------------------------

    def start(self, workers: int) -> None:
        if not _orphans_stopped:  # once per runner, before its first stack
            stop_orphaned_stacks()
            _orphans_stopped.append(True)
        self._launch_api()
        launched = [self._launch_worker() for _ in range(workers)]
        self._wait_api()
        for index in launched:
            self._wait_worker(index)

    def start_worker(self, *, concurrency: int | None = None) -> int:
        """Start one more worker, wait until it is ready, and return its index."""
        index = self._launch_worker(concurrency)
        self._wait_worker(index)
        return index

    def _spawn(self, label: str, args: list[str]) -> subprocess.Popen[bytes]:
        with self.log_path(label).open("ab") as log:
            return subprocess.Popen(
                [self._command, *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.log_dir,  # away from any .env in the checkout
                start_new_session=True,
            )

    def _launch_api(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        args = ["api", "--port", str(port), "--workers", str(self.api_workers)]
        self.api_proc = self._spawn("api", args)

    def _wait_api(self, attempts: int = 3) -> None:
        for attempt in range(attempts):
            assert self.api_proc is not None
            try:
                self._wait_until("api", self.api_proc, self._api_ready)
                return
            except StackError:
                # Another process may have taken the free port between our probe and its bind.
                if "address already in use" not in self.log_text("api") or attempt == attempts - 1:
                    raise
                self._launch_api()

    def _api_ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _launch_worker(self, concurrency: int | None = None) -> int:
        index = len(self.worker_procs)
        name = f"w{index}-{self._token}"
        args = ["worker", f"--concurrency={concurrency or self.concurrency}"]
        self.worker_procs.append(self._spawn(f"worker-{index}", [*args, f"--hostname={name}@%h"]))
        self.worker_names.append(name)
        return index

    def _wait_worker(self, index: int) -> None:
        ready = re.compile(rf"\b{re.escape(self.worker_names[index])}@\S+ ready\.")
        self._wait_until(
            f"worker {index}",
            self.worker_procs[index],
            lambda: ready.search(self.log_text(f"worker-{index}")) is not None,
        )

    def _wait_until(
        self, what: str, proc: subprocess.Popen[bytes], ready: Callable[[], bool]
    ) -> None:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not ready():
            if proc.poll() is not None:
                raise StackError(
                    f"{what} exited with {proc.returncode} while starting\n{self.logs()}"
                )
            if time.monotonic() > deadline:
                raise StackError(f"{what} not ready after {START_TIMEOUT_SECONDS} s\n{self.logs()}")
            time.sleep(0.1)

    # -- using ----------------------------------------------------------------------------

    def client(self, headers: Mapping[str, str] | None = None) -> httpx.Client:
        """An HTTP client for the API (closed at teardown if the test does not close it)."""
        client = httpx.Client(base_url=self.url, headers=dict(headers or {}), timeout=30)
        self._clients.append(client)
        return client

    def worker_child_pids(self, index: int) -> list[int]:
        """The prefork pool processes of worker ``index``."""
        return child_pids(self.worker_procs[index].pid)

    def kill_worker(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to worker ``index`` and its pool children; for SIGKILL, reap it."""
        proc = self.worker_procs[index]
        signal_group(proc.pid, sig)
        if sig == signal.SIGKILL:
            proc.wait(timeout=STOP_TIMEOUT_SECONDS)

    def messages_received(self, index: int) -> int:
        """How many Celery messages worker ``index`` has taken from the queue (from its log)."""
        return len(re.findall(r"Task \S+\[[0-9a-f-]+\] received", self.log_text(f"worker-{index}")))

    def first_steps(self, index: int) -> set[str]:
        """The tasks whose first step worker ``index`` committed (from its log)."""
        found = re.findall(
            r"step 1 committed in \S+ ms \[task_id=(\S+) ", self.log_text(f"worker-{index}")
        )
        return set(found)

    # -- logs -----------------------------------------------------------------------------

    def log_path(self, label: str) -> Path:
        return self.log_dir / f"{label}.log"

    def log_text(self, label: str) -> str:
        """One process's log: ``api`` or ``worker-<index>``."""
        try:
            return self.log_path(label).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def labels(self) -> list[str]:
        return ["api", *(f"worker-{i}" for i in range(len(self.worker_procs)))]

    def logs(self, tail: int | None = None) -> str:
        """Every process's log, each under a header (only the last ``tail`` lines if given)."""
        parts = []
        for label in self.labels():
            lines = self.log_text(label).splitlines()
            shown = lines[-tail:] if tail else lines
            parts.append(f"----- {label} ({len(lines)} lines) -----\n" + "\n".join(shown))
        return "\n".join(parts)

    # -- stopping -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every process and its children; safe to call twice."""
        for client in self._clients:
            client.close()
        procs = [p for p in (self.api_proc, *self.worker_procs) if p is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # a warm shutdown lets a running step finish
            signal_group(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in procs:
            signal_group(proc.pid, signal.SIGKILL)  # whatever is left, prefork children included
            proc.wait()
        self._delete_queue()

    def _delete_queue(self) -> None:
        queue = self.env["RATCHET_QUEUE_NAME"]
        with redis.Redis.from_url(self.env["RATCHET_REDIS_URL"]) as conn:
            keys = list(conn.scan_iter(match=f"*{queue}*"))
            if keys:
                conn.delete(*keys)


StackFactory = Callable[..., Stack]
Run = Callable[..., subprocess.CompletedProcess[str]]


def stack_env(
    service_env: Mapping[str, str], *, queue: str, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a stack's processes: this run's services on a Celery queue of its
    own (the run's queue name with ``-<queue>`` appended), unbuffered logs, the checkout
    importable, then ``env`` over it all."""
    return {
        **os.environ,
        **service_env,
        "RATCHET_QUEUE_NAME": f"{service_env['RATCHET_QUEUE_NAME']}-{queue}",
        "PYTHONUNBUFFERED": "1",
        # Extension modules named in RATCHET_AGENT_MODULES (tests.sample_agents) import.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **(env or {}),
    }


@contextlib.contextmanager
def running_stack(
    service_env: Mapping[str, str],
    log_dir: Path,
    *,
    queue: str,
    env: Mapping[str, str] | None = None,
    workers: int = 1,
    concurrency: int = 1,
) -> Iterator[Stack]:
    """A started :class:`Stack` on the queue ``queue`` (see :func:`stack_env`), stopped when
    the block ends, even when it did not start."""
    started = Stack(
        env=stack_env(service_env, queue=queue, env=env), log_dir=log_dir, concurrency=concurrency
    )
    try:
        started.start(workers=workers)
        yield started
    finally:
        started.close()


def module_stack_fixture(queue: str, env: Mapping[str, str] | None = None) -> Any:
    """A module-scoped fixture: one API and one worker (``--concurrency=1``) for every test of
    the module, with ``env`` added, on the queue ``queue``. For modules none of whose tests
    stops a process; name it ``module_stack`` to give the module :func:`fleet`,
    :func:`client`, :func:`user` and :func:`terminal`."""

    @pytest.fixture(scope="module")
    def module_stack(
        service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[Stack]:
        with running_stack(
            service_env, tmp_path_factory.mktemp(queue), queue=queue, env=env
        ) as started:
            yield started

    return module_stack


def has_failed(request: pytest.FixtureRequest) -> bool:
    """Whether the test of ``request`` failed in any of its phases so far."""
    return any(r.failed for r in request.node.stash.get(REPORTS, {}).values())


def logs_on_failure(shared: Stack, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """Yield a stack shared by several tests; when the test fails, print the tail of each of
    its processes' logs (a fixture's body: ``yield from logs_on_failure(stack, request)``)."""
    yield shared
    if has_failed(request):
        print(shared.logs(tail=LOG_TAIL_LINES))


def run_ratchet(
    *args: str,
    env: Mapping[str, str | None],
    cwd: Path,
    timeout: float = 120,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m ratchet ARGS`` with this process's environment and ``env`` over it (a
    value of None removes the variable), in ``cwd`` (away from any .env of the checkout); its
    output read as text."""
    merged = dict(os.environ)
    for name, value in env.items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    return subprocess.run(
        [sys.executable, "-m", "ratchet", *args],
        input=input,
        capture_output=True,
        text=True,
        env=merged,
        cwd=cwd,
        timeout=timeout,
        check=False,
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    item.stash.setdefault(REPORTS, {})[report.when] = report
    return report


@pytest.fixture
def stack(
    service_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[StackFactory]:
    """Start stacks: ``stack(workers=2, concurrency=1, env=None, api_workers=1) -> Stack``.

    A :class:`Stack` offers ``url``, ``client(headers=None)``, ``worker_procs``,
    ``worker_names``, ``worker_child_pids(i)``, ``start_worker()``, ``kill_worker(i, sig)``,
    ``messages_received(i)`` and ``logs(tail=None)``. Every stack is stopped after the test,
    and when the test failed the tail of each process's log is printed with the failure.
    """
    stacks: list[Stack] = []

    def start(
        workers: int = 2,
        concurrency: int = 1,
        env: Mapping[str, str] | None = None,
        api_workers: int = 1,
    ) -> Stack:
        log_dir = tmp_path / f"stack-{len(stacks)}"
        log_dir.mkdir()
        merged = stack_env(service_env, queue=uuid.uuid4().hex[:8], env=env)
        started = Stack(
            env=merged, log_dir=log_dir, concurrency=concurrency, api_workers=api_workers
        )
        stacks.append(started)
        started.start(workers)
        return started

    yield start
    failed = has_failed(request)
    for started in stacks:
        if failed:
            print(started.logs(tail=LOG_TAIL_LINES))
        started.close()


@pytest.fixture
def forget_unacked(service_env: dict[str, str]) -> Iterator[None]:
    """After the test's stacks are stopped, forget the messages its killed workers held
    (``pytestmark = pytest.mark.usefixtures("forget_unacked")`` in a module that kills them).

    The broker keeps a message a worker took and never acked aside, outside the queue's keys,
    for the visibility timeout (an hour); with the worker dead, nobody will ever want it.
    """
    yield
    prefix = f"{service_env['RATCHET_QUEUE_NAME']}-"
    with redis.Redis.from_url(service_env["RATCHET_REDIS_URL"]) as conn:
        for tag, raw in conn.hgetall("unacked").items():
            if str(json.loads(raw)[2]).startswith(prefix):
                conn.hdel("unacked", tag)
                conn.zrem("unacked_index", tag)


@pytest.fixture
def database_proxy(service_env: dict[str, str]) -> Iterator[DatabaseProxy]:
    """A TCP proxy in front of this run's PostgreSQL that a test can make go silent; a stack
    reaches the database through it with ``env=database_proxy.stack_env()``."""
    started = DatabaseProxy(service_env["RATCHET_DATABASE_URL"])
    yield started
    started.close()


# -- a module's shared stack (see module_stack_fixture) --------------------------------------------


@pytest.fixture
def fleet(module_stack: Stack, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """The module's stack; when a test fails, the tail of each process's log is printed."""
    yield from logs_on_failure(module_stack, request)


@pytest.fixture
def client(fleet: Stack, tenant: TenantHandle) -> Iterator[Client]:
    """The Python client on the module's stack, with the tenant's key."""
    with Client(fleet.url, tenant.key) as opened:
        yield opened


@pytest.fixture
def user(fleet: Stack, tenant: TenantHandle) -> dict[str, str]:
    """The environment of a person at a terminal, with the tenant's key."""
    return {"RATCHET_URL": fleet.url, "RATCHET_KEY": tenant.key}


@pytest.fixture
def ratchet(tmp_path: Path) -> Run:
    """Run ``python -m ratchet ARGS`` with ``env`` (RATCHET_URL, RATCHET_KEY) added."""

    def run(
        *args: str, env: Mapping[str, str | None] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return run_ratchet(*args, env=env or {}, cwd=tmp_path)

    return run


@pytest.fixture
def terminal(user: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., Terminal]]:
    """Start ``ratchet ARGS`` in a pseudo-terminal as the tenant's user: ``terminal("chat",
    "--agent", "ops") -> Terminal``. Each is killed after the test if it still runs."""
    opened: list[Terminal] = []

    def start(*args: str) -> Terminal:
        opened.append(Terminal(list(args), user, tmp_path))
        return opened[-1]

    yield start
    for term in opened:
        term.kill()
