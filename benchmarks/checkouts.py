"""Where each side of a before-and-after benchmark runs.

A side is a checkout of Ratchet: this working tree (``after``), or a commit checked out with
``git worktree add`` into a temporary directory (``before``). Its processes run this
interpreter (the same virtualenv, so the same libraries) from the checkout's directory with
the checkout first on ``PYTHONPATH``: ``python -c`` puts the working directory ahead of the
editable install's import hook, so the checkout's ``api``, ``workers``, ``shared`` and
``ratchet`` are the ones imported. Each process prints the file its ``shared`` came from as the
first line of its log, and a stack refuses to run if that file is not the checkout's.

Each stack gets a PostgreSQL database of its own (a copy of a per-side template migrated with
the checkout's own ``ratchet migrate``) and runs on a Redis database that was empty when the
run claimed it; everything made is dropped at the end.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import psycopg
import redis
from psycopg import sql

from benchmarks.harness.processes import Child, free_port, wait_ok, wait_until

ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
REDIS_URL = "redis://127.0.0.1:6379/{db}"
# Databases 0 (the default) and 15 (the test suite's) are left alone.
REDIS_DBS = range(1, 15)
CLAIM_KEY = "ratchet-neighbours-bench:claim"
CODE_MARK = "ratchet-code: "
# The command every process of a side runs: say which code it imported, then be `ratchet`.
LAUNCH = (
    "import sys, shared; "
    f"print({CODE_MARK!r} + shared.__file__, file=sys.stderr, flush=True); "
    "from ratchet.cli import main; sys.argv[0] = 'ratchet'; main()"
)
START_SECONDS = 120.0  # a busy 2-core host imports slowly
CLI_SECONDS = 120.0
WORKER_READY = re.compile(r"@\S+ ready\.")


@dataclass(frozen=True)
class Checkout:
    """One side's code: ``root`` holds its ``api``, ``workers``, ``shared`` and ``ratchet``."""

    side: str
    root: Path
    commit: str
    dirty: bool  # the working tree differs from ``commit``

    def describe(self) -> dict[str, object]:
        return {"root": str(self.root), "commit": self.commit, "uncommitted_changes": self.dirty}


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


@contextmanager
def checkouts(sides: list[str], *, before: str, repo: Path) -> Iterator[dict[str, Checkout]]:
    """The checkouts of ``sides``: ``after`` is ``repo``'s working tree as it is now,
    ``before`` the commit ``before`` in a temporary worktree, removed on exit."""
    found: dict[str, Checkout] = {}
    scratch = Path(tempfile.mkdtemp(prefix="ratchet-neighbours-"))
    worktree = scratch / "before"
    try:
        if "before" in sides:
            commit = git(repo, "rev-parse", "--verify", f"{before}^{{commit}}")
            git(repo, "worktree", "add", "--detach", str(worktree), commit)
            found["before"] = Checkout("before", worktree, commit, dirty=False)
        if "after" in sides:
            changed = git(repo, "status", "--porcelain", "--untracked-files=no")
            found["after"] = Checkout("after", repo, git(repo, "rev-parse", "HEAD"), bool(changed))
        yield found
    finally:
        if worktree.exists():
            with suppress(RuntimeError):
                git(repo, "worktree", "remove", "--force", str(worktree))
            with suppress(RuntimeError):
                git(repo, "worktree", "prune")
        shutil.rmtree(scratch, ignore_errors=True)


def side_env(checkout: Checkout, *, database: str, redis_db: int, queue: str) -> dict[str, str]:
    """The environment of a side's processes: this environment without any ``RATCHET_``
    setting of its own (the bench decides them all), the checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RATCHET_", "PYTHON"))}
    env |= {
        "PYTHONPATH": str(checkout.root),
        "PYTHONUNBUFFERED": "1",
        "RATCHET_DATABASE_URL": DATABASE_URL.format(name=database),
        "RATCHET_REDIS_URL": REDIS_URL.format(db=redis_db),
        "RATCHET_BROKER_URL": REDIS_URL.format(db=redis_db),
        "RATCHET_QUEUE_NAME": queue,
        "RATCHET_SCRIPTED_MODEL": "true",
        # The hostile tenant's drip server and hanging receiver, and the quiet tenant's
        # receiver, all listen on loopback: allow-listed, so nothing else is reachable.
        "RATCHET_HTTP_ALLOWED_HOSTS": "127.0.0.1",
        "RATCHET_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
        "RATCHET_WORKER_METRICS_PORT": "0",
    }
    return env


def code_of(text: str) -> str | None:
    """The file ``shared`` was imported from, as a process's first log line says."""
    for line in text.splitlines():
        if line.startswith(CODE_MARK):
            return line.removeprefix(CODE_MARK).strip()
    return None


def require_code(checkout: Checkout, text: str, *, what: str) -> str:
    """The file a process's ``shared`` came from; RuntimeError unless it is the checkout's."""
    code = code_of(text)
    if code is None or not Path(code).resolve().is_relative_to(checkout.root.resolve()):
        raise RuntimeError(f"{checkout.side} {what} ran code from {code}, not {checkout.root}")
    return code


def run_cli(checkout: Checkout, *args: str, env: dict[str, str]) -> str:
    """``ratchet ARGS`` of the checkout, to its end; its stdout (a key, for ``tenants
    create``). RuntimeError with its stderr if it fails or runs from other code."""
    done = subprocess.run(
        [sys.executable, "-c", LAUNCH, *args],
        cwd=checkout.root,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_SECONDS,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{checkout.side}: ratchet {' '.join(args)}: {done.stderr[-2000:]}")
    require_code(checkout, done.stderr, what=f"ratchet {args[0]}")
    return done.stdout.strip()


class CheckoutProcess(Child):
    """``ratchet ARGS`` of a checkout, in a process group of its own, logging to ``log``.

    Not started by ``Child.__init__``: it runs from the checkout (its directory, its path),
    and its log is a named file opened for appending, so reading it (the first line says
    which code runs) never moves where the process writes."""

    def __init__(self, checkout: Checkout, *args: str, env: dict[str, str], log: Path) -> None:
        self.name = f"{checkout.side}: ratchet {args[0]}"
        self.path = log
        self.log = log.open("a+b")
        self.popen = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, *args],
            cwd=checkout.root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL to its whole group (prefork children too), at once: a stack is thrown away
        after its pattern, and a frozen or wedged process would only make a graceful stop
        wait."""
        with suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        self.log.close()


@dataclass(frozen=True)
class RunningStack:
    url: str
    code: str  # the file the API's and the worker's ``shared`` came from


@contextmanager
def stack(
    checkout: Checkout, env: dict[str, str], *, worker_args: list[str], logs: Path
) -> Iterator[RunningStack]:
    """``ratchet api`` and one ``ratchet worker WORKER_ARGS`` of the checkout, while the
    context lasts; yields once the API is ready and the worker has said it is."""
    port = free_port()
    api = CheckoutProcess(checkout, "api", "--port", str(port), env=env, log=logs / "api.log")
    worker = CheckoutProcess(checkout, "worker", *worker_args, env=env, log=logs / "worker.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ok(f"{url}/readyz", api, seconds=START_SECONDS)

        def ready() -> bool:
            return WORKER_READY.search(worker.text()) is not None

        wait_until(ready, what=f"{worker.name} not ready", child=worker, seconds=START_SECONDS)
        code = require_code(checkout, api.text(), what="api")
        require_code(checkout, worker.text(), what="worker")
        yield RunningStack(url=url, code=code)
    finally:
        worker.kill()
        api.kill()


class Scratch:
    """The PostgreSQL databases and the Redis database a run made or claimed: each database
    is dropped when its stack is done, and the Redis database (empty when claimed, so every
    key in it is the run's) is emptied between stacks and at the end."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.databases: list[str] = []
        self.redis_db = self._claim_redis()

    def _claim_redis(self) -> int:
        for db in REDIS_DBS:
            client = redis.Redis.from_url(REDIS_URL.format(db=db))
            with client:
                if client.dbsize() == 0 and client.set(CLAIM_KEY, self.run_id, nx=True):
                    return db
        raise RuntimeError(f"no empty Redis database among {REDIS_DBS.start}..{REDIS_DBS.stop}")

    def reset_redis(self) -> None:
        """Empty the claimed database (every key in it is this run's), keeping the claim."""
        with redis.Redis.from_url(REDIS_URL.format(db=self.redis_db)) as client:
            client.flushdb()
            client.set(CLAIM_KEY, self.run_id)

    def create_database(self, name: str, *, template: str | None = None) -> str:
        full = f"ratchet_nb_{self.run_id}_{name}"
        query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(full))
        if template is not None:
            query += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(query)
        self.databases.append(full)
        return full

    def drop_database(self, name: str) -> None:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
        if name in self.databases:
            self.databases.remove(name)

    def close(self) -> None:
        for name in list(self.databases):
            with suppress(psycopg.Error):
                self.drop_database(name)
        with redis.Redis.from_url(REDIS_URL.format(db=self.redis_db)) as client:
            client.flushdb()
