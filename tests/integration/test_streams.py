"""Streams and long polls under load and after a retry, against the real PostgreSQL and Redis.

The API runs in-process (ASGI); the event hub is the real one, on Redis pub/sub.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest
import redis
from fastapi.testclient import TestClient

from tests.conftest import TenantHandle
from tests.helpers import calculator_script, scripted_task, tool_turn
from tests.integration.test_events import parse_sse

# A model call that fails until its attempts run out (the task fails), then answers once the
# task is retried.
FAILS_THEN_ANSWERS = [
    tool_turn("calculator", expression="6*7"),
    {"error": "server_error", "times": 5, "content": "finally"},
]


def test_after_a_retry_the_stream_runs_past_the_old_failure_to_the_current_end(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    submitted = client.post(
        "/v1/tasks", json=scripted_task(FAILS_THEN_ANSWERS), headers=tenant.headers
    )
    task_id = submitted.json()["id"]
    assert drive(task_id) == "failed"
    assert client.post(f"/v1/tasks/{task_id}/retry", headers=tenant.headers).status_code == 202
    assert drive(task_id) == "succeeded"

    response = client.get(f"/v1/tasks/{task_id}/events", headers=tenant.headers)

    types = [e.type for e in parse_sse(response.text)]
    assert "task.failed" in types
    assert types[types.index("task.failed") + 1] == "task.queued"  # the retry
    assert types[-1] == "task.succeeded"
    assert types.count("task.succeeded") == 1


def test_a_stream_of_a_task_that_failed_last_ends_at_its_failure(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    submitted = client.post(
        "/v1/tasks", json=scripted_task(FAILS_THEN_ANSWERS), headers=tenant.headers
    )
    task_id = submitted.json()["id"]
    assert drive(task_id) == "failed"

    response = client.get(f"/v1/tasks/{task_id}/events", headers=tenant.headers)

    assert [e.type for e in parse_sse(response.text)][-1] == "task.failed"


# --- the event hub when Redis goes away -------------------------------------------------------


class RedisDoor:
    """A TCP door in front of the real Redis: shut, it hangs up on every connection (as a
    Redis that is down would); open, it passes bytes both ways. Counts connection attempts."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.open = False
        self.attempts = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for pipe in self._pipes:
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.attempts += 1
        if not self.open:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            pipe = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(pipe)

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        finally:
            sink.close()


@pytest.fixture
def hub_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="ratchet.api.events")
    return caplog


def test_a_redis_outage_is_logged_once_backed_off_and_its_end_logged_once(
    service_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    hub_logs: pytest.LogCaptureFixture,
) -> None:
    from api.event_hub import EventHub
    from shared.settings import get_settings

    redis_url = urlsplit(service_env["RATCHET_REDIS_URL"])
    door = RedisDoor((redis_url.hostname or "127.0.0.1", redis_url.port or 6379))
    woken: list[bool] = []

    async def scenario() -> None:
        port = await door.start()
        monkeypatch.setenv("RATCHET_REDIS_URL", f"redis://127.0.0.1:{port}{redis_url.path}")
        get_settings.cache_clear()
        hub = EventHub()
        await hub.start()
        try:
            await asyncio.sleep(OUTAGE_SECONDS)  # Redis is down
            down_attempts = door.attempts
            door.open = True
            await _until(lambda: "restored" in hub_logs.text, timeout=40)
            async with hub.watch("t-1") as changed:
                changed.clear()
                await asyncio.to_thread(_publish, service_env["RATCHET_REDIS_URL"], "t-1")
                woken.append(await _woken(changed))
        finally:
            await hub.stop()
            await door.close()
            get_settings.cache_clear()
        # A retry a second would have made OUTAGE_SECONDS + 1 attempts; doubling from 0.5 s
        # makes 4 (at 0, 0.5, 1.5 and 3.5 s); one more is slack for a slow machine.
        assert down_attempts <= 5, down_attempts

    asyncio.run(scenario())

    records = [r for r in hub_logs.records if r.name == "ratchet.api.events"]
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in records]
    assert warnings[0].exc_info is None
    assert "\n" not in warnings[0].getMessage()
    assert [r.getMessage() for r in records if "restored" in r.getMessage()] == [
        records[-1].getMessage()
    ]
    assert woken == [True]  # wake-ups flow again once Redis is back


OUTAGE_SECONDS = 6.0


def _publish(url: str, task_id: str) -> None:
    from shared.constants import EVENTS_CHANNEL_PREFIX

    with redis.Redis.from_url(url) as conn:
        conn.publish(EVENTS_CHANNEL_PREFIX + task_id, "1")


async def _woken(event: asyncio.Event) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout=10)
    except TimeoutError:
        return False
    return True


async def _until(condition: Callable[[], bool], *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


# --- caps on waiting requests -----------------------------------------------------------------


@pytest.fixture
def capped(service_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The API with room for 3 waiting requests, 2 of them per tenant."""
    from api.main import create_app
    from shared.settings import get_settings

    monkeypatch.setenv("RATCHET_API_MAX_STREAMS", "3")
    monkeypatch.setenv("RATCHET_API_MAX_STREAMS_PER_TENANT", "2")
    get_settings.cache_clear()
    try:
        with TestClient(create_app()) as test_client:
            yield test_client
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()


def _queued(client: TestClient, tenant: TenantHandle) -> str:
    response = client.post(
        "/v1/tasks", json=scripted_task(calculator_script()), headers=tenant.headers
    )
    task_id: str = response.json()["id"]
    return task_id  # no worker runs it: it stays queued


def _assert_retry_later(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert response.json()["status"] == status
    assert int(response.headers["retry-after"]) > 0


def test_long_polls_are_capped_per_tenant_and_per_process(
    capped: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    from api.stream_limits import limits

    noisy, quiet, third = make_tenant(), make_tenant(), make_tenant()
    noisy_task, quiet_task = _queued(capped, noisy), _queued(capped, quiet)
    poll = f"/v1/tasks/{noisy_task}"
    with ThreadPoolExecutor(3) as pool:
        held = [
            pool.submit(capped.get, poll, params={"wait": 8}, headers=noisy.headers)
            for _ in range(2)
        ]
        _wait_for(lambda: limits.held_by(noisy.id) == 2)

        _assert_retry_later(capped.get(poll, params={"wait": 8}, headers=noisy.headers), 429)
        # Another tenant still gets its answers, and its own long poll (the third slot) …
        assert capped.get(poll, headers=noisy.headers).status_code == 200  # no wait: no slot
        assert capped.get("/v1/tasks", headers=quiet.headers).status_code == 200
        quiet_poll = pool.submit(
            capped.get, f"/v1/tasks/{quiet_task}", params={"wait": 8}, headers=quiet.headers
        )
        _wait_for(lambda: limits.total == 3)
        # … and then the process is full, for every tenant.
        third_task = _queued(capped, third)
        full = capped.get(f"/v1/tasks/{third_task}", params={"wait": 8}, headers=third.headers)
        _assert_retry_later(full, 503)

        assert [f.result().status_code for f in [*held, quiet_poll]] == [200, 200, 200]
    assert limits.total == 0  # every slot came back


def test_an_event_stream_takes_a_slot_and_gives_it_back(
    capped: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    from api.stream_limits import limits

    task_id = _queued(capped, tenant)
    with ThreadPoolExecutor(2) as pool:
        streams = [
            pool.submit(capped.get, f"/v1/tasks/{task_id}/events", headers=tenant.headers)
            for _ in range(2)
        ]
        _wait_for(lambda: limits.held_by(tenant.id) == 2)

        refused = capped.get(f"/v1/tasks/{task_id}/events", headers=tenant.headers)
        _assert_retry_later(refused, 429)

        assert drive(task_id) == "succeeded"  # the streams end with the task
        assert [f.result().status_code for f in streams] == [200, 200]
    assert limits.total == 0


def _wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
