"""The hostile tenant's patterns, and the loopback servers they need.

Each pattern is what one of the noisy-neighbour findings did to the service: calls that never
end, a calculator expression that holds a core, more slow tasks than the worker has slots,
webhook endpoints that never answer, and a flood of connections that never finish their
request head. A pattern starts its load, keeps it up while the quiet tenant is measured, and
stops it, saying what it did. Everything listens and connects on loopback only, and every
load is bounded in count and in time.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar, Protocol

import httpx

# Each party connects from a loopback address of its own, as clients on different hosts
# would: a per-client limit then tells the hostile tenant from the quiet one.
HOSTILE_SOURCE = "127.0.0.3"
FLOOD_SOURCE = "127.0.0.4"
DRIP_SECONDS = 3.0  # one byte this often, forever: per-read timeouts never fire
BOMB = "(9**9999)**1500"
SETUP_SECONDS = 60.0  # the most a pattern's submissions may take


def hostile_client(api: str, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=api,
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
        transport=httpx.HTTPTransport(local_address=HOSTILE_SOURCE),
    )


def scripted(script: list[dict[str, Any]], *, tools: list[str]) -> dict[str, Any]:
    """A submit body of the scripted model that plays ``script``."""
    return {
        "input": "hostile",
        "model": "scripted",
        "model_options": {"script": script},
        "tools": tools,
        "max_steps": len(script) + 1,
    }


def tool_turn(name: str, **arguments: Any) -> dict[str, Any]:
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


def post_many(
    http: httpx.Client, body: dict[str, Any], count: int, *, path: str = "/v1/tasks"
) -> Counter[str]:
    """POST ``body`` to ``path`` ``count`` times, within ``SETUP_SECONDS`` in all; the
    answers' status codes (or errors, or ``not sent``), counted: a service that refuses part
    of a flood says so here, and one that hangs cannot stretch the run."""
    answers: Counter[str] = Counter()
    deadline = time.monotonic() + SETUP_SECONDS
    for sent in range(count):
        if time.monotonic() > deadline:
            answers["not sent"] += count - sent
            break
        try:
            answers[str(http.post(path, json=body).status_code)] += 1
        except httpx.HTTPError as exc:
            answers[type(exc).__name__] += 1
    return answers


class _Quiet(BaseHTTPRequestHandler):
    def log_message(self, *_: Any) -> None:
        pass


class DripServer:
    """An HTTP server on loopback that answers every request with a 200 whose body comes a
    byte every ``DRIP_SECONDS``, forever (until :meth:`stop`)."""

    def __init__(self) -> None:
        stopping = self.stopping = threading.Event()

        class Handler(_Quiet):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-length", str(10**9))
                self.end_headers()
                try:
                    while not stopping.wait(DRIP_SECONDS):
                        self.wfile.write(b".")
                        self.wfile.flush()
                except OSError:  # the caller gave up
                    return

            def do_POST(self) -> None:
                self.do_GET()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/drip"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


class HangingReceiver:
    """A TCP listener on loopback that accepts every connection and never answers: a webhook
    endpoint that hangs. Connections are held until :meth:`stop`."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.listener.settimeout(0.5)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/hook"
        self.held: list[socket.socket] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.held.append(conn)

    def stop(self) -> int:
        """Close everything; how many connections it accepted."""
        self.stopping.set()
        self.thread.join(timeout=5)
        self.listener.close()
        for conn in self.held:
            conn.close()
        return len(self.held)


class QuietReceiver:
    """The quiet tenant's webhook receiver on loopback: answers at once, and notes when each
    task's first terminal event arrived (``time.monotonic()``)."""

    def __init__(self) -> None:
        arrived = self.arrived = {}  # type: dict[str, float]

        class Handler(_Quiet):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                at = time.monotonic()
                data = json.loads(body or b"{}").get("data") or {}
                if isinstance(data, dict) and isinstance(data.get("id"), str):
                    arrived.setdefault(data["id"], at)
                self.send_response(204)
                self.send_header("content-length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.request_queue_size = 1024
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Pattern(Protocol):
    """A hostile load: ``start`` returns once it is under way, ``stop`` ends it and says
    what it did. ``settle_seconds``: how long after ``start`` the load is at full strength,
    before the quiet tenant is measured."""

    @property
    def name(self) -> str: ...

    @property
    def settle_seconds(self) -> float: ...

    def start(self, api: str, key: str) -> None: ...

    def stop(self) -> dict[str, Any]: ...


@dataclass
class Baseline:
    """No hostile load: the figures the others are read against."""

    name: ClassVar[str] = "baseline"
    settle_seconds: float = 0.0

    def start(self, api: str, key: str) -> None:
        pass

    def stop(self) -> dict[str, Any]:
        return {}


@dataclass
class HungCalls:
    """``tasks`` tasks whose model calls ``http_request`` on a drip endpoint."""

    tasks: int = 40
    name: ClassVar[str] = "hung-calls"
    settle_seconds: float = 3.0
    answers: Counter[str] = field(default_factory=Counter)

    def start(self, api: str, key: str) -> None:
        self.drip = DripServer()
        body = scripted(
            [tool_turn("http_request", url=self.drip.url), {"content": "done"}],
            tools=["http_request"],
        )
        with hostile_client(api, key) as http:
            self.answers = post_many(http, body, self.tasks)

    def stop(self) -> dict[str, Any]:
        self.drip.stop()
        return {"hung_tasks": self.tasks, "submit_answers": dict(self.answers)}


@dataclass
class CalculatorBomb:
    """``bombs`` calculator calls of ``BOMB``, one every ``every_seconds`` (the first at
    once), each in a task of its own: the same number on either side, however long its
    quiet load lasts."""

    bombs: int = 4
    every_seconds: float = 5.0
    name: ClassVar[str] = "calculator"
    settle_seconds: float = 2.0
    answers: Counter[str] = field(default_factory=Counter)

    def start(self, api: str, key: str) -> None:
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._bomb, args=(api, key), daemon=True)
        self.thread.start()

    def _bomb(self, api: str, key: str) -> None:
        body = scripted(
            [tool_turn("calculator", expression=BOMB), {"content": "done"}], tools=["calculator"]
        )
        with hostile_client(api, key) as http:
            for _ in range(self.bombs):
                self.answers.update(post_many(http, body, 1))
                if self.stopping.wait(self.every_seconds):
                    return

    def stop(self) -> dict[str, Any]:
        self.stopping.set()
        self.thread.join(timeout=60)
        return {
            "expression": BOMB,
            "bombs": sum(self.answers.values()),
            "submit_answers": dict(self.answers),
        }


@dataclass
class SlowFlood:
    """``tasks`` tasks whose one model turn takes 60 s: more than the worker's slots."""

    tasks: int = 60
    name: ClassVar[str] = "slow-flood"
    settle_seconds: float = 3.0
    answers: Counter[str] = field(default_factory=Counter)

    def start(self, api: str, key: str) -> None:
        body = scripted([{"content": "slow", "delay_ms": 60_000}], tools=[])
        with hostile_client(api, key) as http:
            self.answers = post_many(http, body, self.tasks)

    def stop(self) -> dict[str, Any]:
        return {"slow_tasks": self.tasks, "submit_answers": dict(self.answers)}


@dataclass
class HangingWebhooks:
    """``endpoints`` webhook endpoints of the hostile tenant on a receiver that never
    answers, and ``tasks`` quick tasks, each of whose end is a delivery to every one."""

    endpoints: int = 100
    tasks: int = 20
    name: ClassVar[str] = "webhooks"
    settle_seconds: float = 5.0
    made: Counter[str] = field(default_factory=Counter)
    answers: Counter[str] = field(default_factory=Counter)

    def start(self, api: str, key: str) -> None:
        self.receiver = HangingReceiver()
        with hostile_client(api, key) as http:
            endpoint = {"url": self.receiver.url}
            self.made = post_many(http, endpoint, self.endpoints, path="/v1/webhook-endpoints")
            body = scripted([{"content": "done"}], tools=[])
            self.answers = post_many(http, body, self.tasks)

    def stop(self) -> dict[str, Any]:
        return {
            "endpoints_asked": self.endpoints,
            "endpoint_answers": dict(self.made),
            "tasks": self.tasks,
            "submit_answers": dict(self.answers),
            "connections_held": self.receiver.stop(),
        }
