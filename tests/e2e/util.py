"""Helpers for tests that talk to a running stack: over HTTP, and as a person at a terminal."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.engine import make_url

from tests.helpers import TERMINAL

LONG_POLL_SECONDS = 10.0
# ``python -m ratchet`` with Ctrl-C as at a terminal, even when this run ignores SIGINT (as a
# shell's background job does, and its children with it).
AT_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'ratchet'; runpy.run_module('ratchet', run_name='__main__')"
)


def wait_all(
    client: httpx.Client,
    headers: Mapping[str, str] | None,
    ids: Iterable[str],
    timeout: float = 60.0,
) -> dict[str, dict[str, Any]]:
    """Long-poll (``GET /v1/tasks/{id}?wait=N``) until every task is terminal; return them by id.

    Tasks are polled round-robin, so one stuck task does not hide the others' progress. Past
    ``timeout`` it fails with a count of the unfinished tasks by status.
    """
    deadline = time.monotonic() + timeout
    pending = deque(dict.fromkeys(ids))
    seen: dict[str, dict[str, Any]] = {}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            statuses = Counter(seen[i]["status"] if i in seen else "unseen" for i in pending)
            example = seen.get(pending[0])
            raise AssertionError(
                f"{len(pending)} task(s) not terminal after {timeout} s: {dict(statuses)}; "
                f"for example {example}"
            )
        wait = round(min(LONG_POLL_SECONDS, remaining), 1)
        task_id = pending.popleft()
        response = client.get(
            f"/v1/tasks/{task_id}",
            params={"wait": wait},
            headers=dict(headers or {}),
            timeout=wait + 10,
        )
        assert response.status_code == 200, f"GET /v1/tasks/{task_id}: {response.text}"
        seen[task_id] = response.json()
        if seen[task_id]["status"] not in TERMINAL:
            pending.append(task_id)
    return seen


class Terminal:
    """``ratchet ARGS`` with a pty for its stdin, stdout and stderr; what it printed, and when
    each part of it arrived."""

    def __init__(self, args: list[str], env: Mapping[str, str], cwd: Path) -> None:
        self.master, replica = os.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", AT_A_TERMINAL, *args],
            stdin=replica,
            stdout=replica,
            stderr=replica,
            env={**os.environ, **env, "TERM": "xterm"},
            cwd=cwd,  # away from any .env of the checkout
        )
        os.close(replica)
        self.output, self.read_to = "", 0

    def wait_for(self, text: str, timeout: float = 60.0) -> float:
        """Read until ``text`` has been printed after what the last wait found; the
        wall-clock time it arrived."""
        deadline = time.monotonic() + timeout
        while (found := self.output.find(text, self.read_to)) < 0:
            left = deadline - time.monotonic()
            assert left > 0, f"{text!r} never showed; the terminal shows:\n{self.output}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                self.output += os.read(self.master, 65536).decode(errors="replace")
        self.read_to = found + len(text)
        return time.time()

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> int:
        """Wait for the process to exit by itself; its exit status."""
        code = self.proc.wait(timeout=30)
        os.close(self.master)
        return code

    def kill(self) -> None:
        """Kill the process if it still runs (after a failed test)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class SilentableProxy:
    """Forwards TCP connections to ``target`` until :meth:`go_silent`. Then it keeps every
    connection open, accepts new ones, and forwards nothing: TCP itself never says the server
    is gone, as in a partition or behind a hung proxy."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.silent = threading.Event()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def go_silent(self) -> None:
        self.silent.set()

    def close(self) -> None:
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._sockets.append(client)
            if self.silent.is_set():
                continue  # accepted, and never answered
            upstream = socket.create_connection(self.target)
            self._sockets.append(upstream)
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if not self.silent.is_set():
                    sink.sendall(data)


class DatabaseProxy(SilentableProxy):
    """A :class:`SilentableProxy` in front of the PostgreSQL at ``database_url``."""

    def __init__(self, database_url: str) -> None:
        self.database_url = make_url(database_url)
        super().__init__((self.database_url.host or "127.0.0.1", self.database_url.port or 5432))

    def stack_env(self) -> dict[str, str]:
        """A stack's settings to reach the database through this proxy, with 2 s timeouts on
        a connection, a pooled connection and a statement: once the proxy goes silent, only
        these end a wait."""
        url = self.database_url.set(host="127.0.0.1", port=self.port)
        return {
            "RATCHET_DATABASE_URL": url.render_as_string(hide_password=False),
            "RATCHET_DB_CONNECT_TIMEOUT_SECONDS": "2",
            "RATCHET_DB_POOL_TIMEOUT_SECONDS": "2",
            "RATCHET_DB_STATEMENT_TIMEOUT_SECONDS": "2",
        }
