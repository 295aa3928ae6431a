from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi.testclient import TestClient

from tests.conftest import Configure
from tests.fakes.anthropic_server import MessagesServer
from tests.fakes.openai_server import OpenAIServer, openai_server  # noqa: F401
from tests.helpers import TERMINAL


@pytest.fixture
def client(backend_env: dict[str, str]) -> Iterator[TestClient]:
    """The API in-process (ASGI), on the test's backend: the run's PostgreSQL and Redis, or
    SQLite with the in-process wake-ups."""
    from api.main import create_app

    with TestClient(create_app()) as test_client:
        yield test_client


@pytest.fixture
def drive(backend_env: dict[str, str]) -> Callable[..., str]:
    """Run a task's steps inline, in this process, until it is terminal; return its status."""
    from shared.store.db import transaction
    from shared.store.tables import Task
    from workers.steps.runner import advance

    def run(task_id: str, max_messages: int = 100) -> str:
        for _ in range(max_messages):
            with transaction() as session:
                task = session.get(Task, task_id)
                assert task is not None
                status, step = task.status, task.steps + 1
            if status in TERMINAL or status in ("awaiting_approval", "waiting"):
                return status
            advance(task_id, step)
        raise AssertionError(f"task {task_id} did not finish within {max_messages} steps")

    return run


@pytest.fixture
def journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file the sample agents' tools write each side effect to, one line each."""
    path = tmp_path / "journal"
    path.touch()
    monkeypatch.setenv("RATCHET_TEST_JOURNAL", str(path))
    return path


@pytest.fixture
def failpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Sets ``RATCHET_FAILPOINTS`` (e.g. ``after_model_commit=raise``); cleared after."""

    def set_failpoints(spec: str) -> None:
        monkeypatch.setenv("RATCHET_FAILPOINTS", spec)

    yield set_failpoints
    monkeypatch.delenv("RATCHET_FAILPOINTS", raising=False)


def fresh_providers() -> None:
    """Forget the providers made so far: each holds SDK clients built from the settings of
    the moment (base URL, key)."""
    from workers.providers import _provider

    _provider.cache_clear()


@pytest.fixture
def openai_provider(
    openai_server: OpenAIServer,  # noqa: F811
    configure: Configure,
) -> Iterator[OpenAIServer]:
    """The OpenAI-compatible test server as the ``openai:`` provider, one attempt a call."""
    configure(
        RATCHET_OPENAI_BASE_URL=openai_server.base_url,
        RATCHET_OPENAI_API_KEY="test-key",
        RATCHET_MODEL_MAX_ATTEMPTS="1",
    )
    fresh_providers()
    yield openai_server
    fresh_providers()


@pytest.fixture
def anthropic_provider(configure: Configure) -> Iterator[Callable[..., MessagesServer]]:
    """Starts a Messages-API test server answering with ``replies`` (200s, in order) as the
    ``anthropic:`` provider, one attempt a call; shut down when the test ends."""
    servers: list[MessagesServer] = []

    def start(*replies: dict[str, Any]) -> MessagesServer:
        server = MessagesServer([(200, reply) for reply in replies])
        servers.append(server)
        configure(
            RATCHET_ANTHROPIC_BASE_URL=server.url,
            RATCHET_ANTHROPIC_API_KEY="test-key",
            RATCHET_MODEL_MAX_ATTEMPTS="1",
        )
        fresh_providers()
        return server

    yield start
    for server in servers:
        server.server.shutdown()
    fresh_providers()


@pytest.fixture
def live_url(backend_env: dict[str, str]) -> Iterator[str]:
    """The API served by uvicorn on a free local port, in a background thread, on the test's
    backend."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # On asyncio's own loop: uvloop, closing a loop on a thread that is not the main one,
    # held every stop of a server that had served a live stream for 10 s (``ratchet api``,
    # which runs uvloop on its main thread, stops in a fraction of a second).
    config = uvicorn.Config(
        "api.main:create_app",
        factory=True,
        lifespan="on",
        ws="none",
        log_level="warning",
        loop="asyncio",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert thread.is_alive(), "the API server did not start"
        assert time.monotonic() < deadline, "the API server did not start within 15 s"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()
