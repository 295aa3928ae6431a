"""A real ``ratchet api`` process under hostile clients, while another tenant goes on working.

At once: 4 clients each sending a 100 MB header over raw sockets, 400 slowloris connections
(a byte every 2 s, never finishing their headers) and 1,000 waiting requests (SSE streams and
long polls) from one tenant. Meanwhile a quiet tenant lists its tasks and a probe asks
``/healthz``; every one of their requests must be answered, promptly. Afterwards the API's
memory is back near where it started.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.conftest import TenantHandle
from tests.e2e.conftest import Stack, StackFactory
from tests.helpers import calculator_script, scripted_task

HEADER_TIMEOUT_S = 5
BIG_HEADER_BYTES = 100 * 1024 * 1024
BIG_HEADERS = 4
SLOWLORIS = 400
STREAMS = 1000  # half SSE, half long polls
PER_TENANT = 100  # the default RATCHET_API_MAX_STREAMS_PER_TENANT
CHUNK = b"a" * 65536


@dataclass
class Probe:
    """Latencies of the quiet tenant's requests, taken on a thread of its own."""

    lists: list[float] = field(default_factory=list)
    health: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, url: str, headers: dict[str, str]) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
            while not self.stop.is_set():
                for path, into in (("/v1/tasks", self.lists), ("/healthz", self.health)):
                    started = time.monotonic()
                    try:
                        status = http.get(path).status_code
                    except httpx.HTTPError as exc:
                        self.failures.append(f"{path}: {exc!r}")
                        continue
                    into.append(time.monotonic() - started)
                    if status != 200:
                        self.failures.append(f"{path}: {status}")
                time.sleep(0.05)


def p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100)[98]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads")


def _address(stack: Stack) -> tuple[str, int]:
    host, port = stack.url.removeprefix("http://").split(":")
    return host, int(port)


async def big_header(address: tuple[str, int]) -> tuple[int, bytes]:
    """Send a 100 MB header; return how much went out before the server hung up, and what
    it answered."""
    reader, writer = await asyncio.open_connection(*address)
    sent = 0
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
        while sent < BIG_HEADER_BYTES:
            writer.write(CHUNK)
            await writer.drain()
            sent += len(CHUNK)
        writer.write(b"\r\n\r\n")
        await writer.drain()
    except ConnectionError:
        pass
    try:
        answer = await asyncio.wait_for(reader.read(4096), timeout=10)
    except (ConnectionError, TimeoutError):
        answer = b""
    writer.close()
    return sent, answer


async def slowloris(address: tuple[str, int]) -> float | None:
    """Dribble a request head a byte every 2 s; return when the server dropped us (None if it
    never did within 30 s)."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\n")
        await writer.drain()
        while time.monotonic() - started < 30:
            try:
                if await asyncio.wait_for(reader.read(4096), timeout=2) == b"":
                    return time.monotonic() - started
                return time.monotonic() - started  # an answer (the 408), then the close
            except TimeoutError:
                writer.write(b"X")
                await writer.drain()
    except ConnectionError:
        return time.monotonic() - started
    finally:
        writer.close()
    return None


async def waiting_request(
    address: tuple[str, int], path: str, key: str, hold: asyncio.Event
) -> str:
    """Open one stream or long poll; return its status line's code, or "held" for one the
    server accepted and kept open (an SSE that started, a long poll not yet answered)."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
        )
        await writer.drain()
        try:
            line = await asyncio.wait_for(reader.readline(), timeout=15)
        except TimeoutError:
            await hold.wait()
            return "held"
        status = line.split()[1].decode() if line else "closed"
        head = await reader.readuntil(b"\r\n\r\n")
        if status == "200":
            await hold.wait()
            return "held"
        return status if b"retry-after:" in head.lower() else f"{status} without Retry-After"
    finally:
        writer.close()


async def attack(stack: Stack, noisy: TenantHandle, task_id: str) -> dict[str, object]:
    address = _address(stack)
    hold = asyncio.Event()
    paths = [f"/v1/tasks/{task_id}/events", f"/v1/tasks/{task_id}?wait=60"]
    big = [asyncio.create_task(big_header(address)) for _ in range(BIG_HEADERS)]
    slow = [asyncio.create_task(slowloris(address)) for _ in range(SLOWLORIS)]
    streams = [
        asyncio.create_task(waiting_request(address, paths[i % 2], noisy.key, hold))
        for i in range(STREAMS)
    ]
    await asyncio.sleep(17)  # the refused are answered, the held are waiting
    api_threads = threads(stack.api_proc.pid)  # type: ignore[union-attr]
    hold.set()
    return {
        "big": await asyncio.gather(*big),
        "slow": await asyncio.gather(*slow),
        "streams": Counter(await asyncio.gather(*streams)),
        "threads": api_threads,
    }


def warm_up(stack: Stack, tenant: TenantHandle) -> list[float]:
    """Busy every thread of the API's pool once: "where it started" is a process that has
    served concurrent requests, not one that has only just come up. The latencies of those
    requests: how fast this machine answers a busy API now, with no hostile client."""

    def timed(http: httpx.Client) -> float:
        started = time.monotonic()
        assert http.get("/v1/tasks").status_code == 200
        return time.monotonic() - started

    with (
        httpx.Client(base_url=stack.url, headers=tenant.headers, timeout=30) as http,
        ThreadPoolExecutor(64) as pool,
    ):
        return list(pool.map(lambda _: timed(http), range(640)))


def test_hostile_clients_do_not_hurt_another_tenant(
    stack: StackFactory, make_tenant: type[TenantHandle]
) -> None:
    fleet = stack(workers=0, env={"RATCHET_API_HEADER_TIMEOUT_SECONDS": str(HEADER_TIMEOUT_S)})
    noisy, quiet = make_tenant(), make_tenant()
    with fleet.client(headers=noisy.headers) as http:  # no worker: it stays queued
        task_id = http.post("/v1/tasks", json=scripted_task(calculator_script())).json()["id"]
    with fleet.client(headers=quiet.headers) as http:
        for _ in range(20):
            assert http.post("/v1/tasks", json=scripted_task(calculator_script())).is_success
    busy = warm_up(fleet, quiet)
    pid = fleet.api_proc.pid  # type: ignore[union-attr]
    rss_before = rss_kib(pid)

    probe = Probe()
    prober = threading.Thread(target=probe.run, args=(fleet.url, quiet.headers), daemon=True)
    prober.start()
    outcome = asyncio.run(attack(fleet, noisy, task_id))
    probe.stop.set()
    prober.join(timeout=60)
    rss_peak = rss_kib(pid)

    print(
        f"quiet tenant: {len(probe.lists)} lists, p99 {p99(probe.lists) * 1000:.0f} ms, "
        f"max {max(probe.lists) * 1000:.0f} ms; healthz p99 {p99(probe.health) * 1000:.0f} ms, "
        f"max {max(probe.health) * 1000:.0f} ms; API threads {outcome['threads']}; "
        f"streams {outcome['streams']}; RSS {rss_before} KiB before, {rss_peak} KiB after; "
        f"64 quiet requests at once before the attack: p99 {p99(busy) * 1000:.0f} ms"
    )
    # Every request of the quiet tenant was answered, and none stalled: before the limits one
    # took 4-22 s, waiting for a thread the noisy tenant's requests held (the limits themselves
    # are checked below: streams refused past the tenant's share, no thread per wait). How fast
    # is a timing, and belongs to `ratchet bench neighbours` (target: p99 under 500 ms); here a
    # loaded machine gets room in proportion to how slowly it answered 64 of the quiet
    # tenant's lists at once just before the attack (it answered them in 0.98 s at p99 and the
    # lists during the attack in 5.5 s, on a machine running the rest of the suite beside).
    assert probe.failures == []
    assert p99(probe.lists) < max(10.0, 10 * p99(busy)), (p99(probe.lists), p99(busy))
    assert max(probe.health) < max(5.0, 5 * p99(busy)), (max(probe.health), p99(busy))
    # The 100 MB headers were cut off early with a 431.
    for sent, answer in outcome["big"]:  # type: ignore[attr-defined]
        assert sent < BIG_HEADER_BYTES
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431 ")
    # Every slowloris connection was dropped, soon after the header timeout.
    dropped: list[float | None] = outcome["slow"]  # type: ignore[assignment]
    assert all(d is not None and d < HEADER_TIMEOUT_S + 10 for d in dropped), dropped
    # The noisy tenant got its share of waiting requests; the rest were told to retry later.
    assert outcome["streams"] == Counter({"held": PER_TENANT, "429": STREAMS - PER_TENANT})
    # Waiting requests hold no thread each (anyio's pool is 40 threads at most).
    assert outcome["threads"] < 60  # type: ignore[operator]
    # The API's memory comes back near where it started (four 100 MB headers once took it
    # from 148 to 580 MB). It keeps about a third more than before: the allocator holds on to
    # what 1,400 connections at once needed.
    deadline = time.monotonic() + 20
    while rss_kib(pid) > rss_before * 1.5 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert rss_kib(pid) <= rss_before * 1.5, (rss_before, rss_kib(pid))


FLOOD = 200  # half-open connections from one client: past RATCHET_API_MAX_CONNECTIONS below
FLOOD_ENV = {
    "RATCHET_API_MAX_CONNECTIONS": "64",
    "RATCHET_API_MAX_CONNECTIONS_PER_CLIENT": "32",
    "RATCHET_API_HEADER_TIMEOUT_SECONDS": "60",  # the flood outlasts the test: no timeout helps
}


async def half_open(address: tuple[str, int], hold: asyncio.Event) -> str:
    """From another loopback address, start a request head and never finish it; return
    "held" if the server kept the connection until ``hold``, else what it answered."""
    reader, writer = await asyncio.open_connection(*address, local_addr=("127.0.0.2", 0))
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        await writer.drain()
        read = asyncio.create_task(reader.read(4096))
        await asyncio.wait([read, asyncio.create_task(hold.wait())], return_when="FIRST_COMPLETED")
        if not read.done():
            read.cancel()
            return "held"
        answer = read.result()
        return answer.split(b"\r\n", 1)[0].decode() if answer else "closed"
    finally:
        writer.close()


async def flood_while(
    address: tuple[str, int], work: Callable[[], list[int]]
) -> tuple[Counter[str], list[int]]:
    hold = asyncio.Event()
    conns = [asyncio.create_task(half_open(address, hold)) for _ in range(FLOOD)]
    await asyncio.sleep(2)  # every connection is open, or was refused
    statuses = await asyncio.to_thread(work)
    hold.set()
    return Counter(await asyncio.gather(*conns)), statuses


def test_half_open_connections_of_one_client_do_not_lock_out_another(
    stack: StackFactory, tenant: TenantHandle
) -> None:
    fleet = stack(workers=0, env=FLOOD_ENV)

    def work() -> list[int]:  # a new connection each: each must get in past the flood
        return [
            httpx.get(f"{fleet.url}/v1/tasks", headers=tenant.headers, timeout=30).status_code
            for _ in range(30)
        ]

    flood, statuses = asyncio.run(flood_while(_address(fleet), work))
    print(f"flood: {flood}")
    assert statuses == [200] * 30
    # The flooding client kept its most connections; the rest were refused at once.
    assert flood["held"] == 32, flood
    assert flood["HTTP/1.1 429 Too Many Requests"] == FLOOD - 32, flood


def test_a_late_body_is_one_warning_line(stack: StackFactory, tenant: TenantHandle) -> None:
    fleet = stack(workers=0, env={"RATCHET_API_BODY_TIMEOUT_SECONDS": "1"})

    async def late_body() -> bytes:
        reader, writer = await asyncio.open_connection(*_address(fleet))
        head = (
            f"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {tenant.key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        writer.write(head.encode() + b'{"input": ')
        await writer.drain()
        try:
            return await asyncio.wait_for(reader.read(4096), timeout=20)  # b"": dropped
        finally:
            writer.close()

    async def three() -> list[bytes]:
        return await asyncio.gather(*(late_body() for _ in range(3)))

    assert asyncio.run(three()) == [b""] * 3
    with fleet.client(headers=tenant.headers) as http:
        assert http.get("/v1/tasks").json()["items"] == []  # nothing was submitted
    log = fleet.log_text("api")
    assert len(re.findall(r"WARNING .*body did not arrive within 1\.0 s", log)) == 3, log
    assert "Traceback" not in log
    assert " ERROR " not in log
