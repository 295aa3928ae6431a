"""The ``http_request`` exchange's pieces that need no server: the headers sent, the body's
decoding at the cap, the process's clients (one per host, kept, a bounded number) and the clock
that fires the exchanges' deadlines."""

from __future__ import annotations

import threading
import time

import pytest

from shared.agents import http_exchange
from shared.agents.http_exchange import Clients, Clock, _decode, outgoing_headers


def test_the_calls_key_replaces_the_models_and_host_is_not_forwarded() -> None:
    sent = outgoing_headers(
        {"Host": "internal", "idempotency-KEY": "forged", "X-Kept": "1"}, idempotency_key="t:1-0"
    )
    assert sent == {"X-Kept": "1", "Idempotency-Key": "t:1-0"}


def test_a_character_cut_in_two_by_the_cap_is_left_out() -> None:
    assert _decode("é".encode()[:1], "utf-8", complete=False) == ""
    assert _decode(b"ok", "no-such-encoding", complete=True) == "ok"


def test_one_client_per_host_made_once() -> None:
    clients = Clients()
    first = clients.get("a.example")
    assert clients.get("a.example") is first
    assert clients.get("b.example") is not first


def test_the_least_recently_used_host_is_dropped_past_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http_exchange, "HOSTS_KEPT", 2)
    clients = Clients()
    a = clients.get("a.example")
    clients.get("b.example")
    assert clients.get("a.example") is a  # a used last: b goes next
    clients.get("c.example")
    assert clients.get("a.example") is a
    assert len(clients._by_host) == 2
    assert "b.example" not in clients._by_host


def test_a_client_for_another_process_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    parents = Clients()
    parents.pid = -1  # as a forked child sees its parent's
    monkeypatch.setattr(http_exchange._process, "clients", parents)
    http_exchange.client_for("a.example")
    assert http_exchange._process.clients is not parents
    assert parents._by_host == {}


class _Noted:
    def __init__(self, name: str, fired: list[str], done: threading.Event) -> None:
        self.name, self._fired, self._done = name, fired, done

    def fire(self) -> None:
        self._fired.append(self.name)
        if len(self._fired) == 2:
            self._done.set()


def test_the_clock_fires_each_cutoff_at_its_deadline_the_soonest_first() -> None:
    clock, fired, done = Clock(), list[str](), threading.Event()
    now = time.monotonic()
    clock.add(now + 0.5, _Noted("later", fired, done))  # type: ignore[arg-type]
    clock.add(now + 0.05, _Noted("sooner", fired, done))  # type: ignore[arg-type]
    assert done.wait(30)
    assert fired == ["sooner", "later"]
    assert time.monotonic() >= now + 0.5
