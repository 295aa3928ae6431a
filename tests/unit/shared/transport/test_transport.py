"""The transport boundary (``shared.transport``): chosen once from the settings, one Redis
connection pool per URL with the one set of timeouts, and the in-process transport's gate,
live view and wake-ups. Nothing here talks to Redis: making a client connects nothing."""

from __future__ import annotations

import asyncio
import logging
import time

from shared.settings import Settings, get_settings
from shared.transport import get_transport, transport_for
from shared.transport.local import LocalTransport
from shared.transport.redis import (
    COMMAND_TIMEOUT_SECONDS,
    CONNECT_TIMEOUT_SECONDS,
    RedisTransport,
)
from tests.conftest import environment

NOWHERE = "redis://127.0.0.1:1/0"  # nobody listens: a client made here must not connect
LOG = logging.getLogger("tests.transport")


def test_the_in_process_queue_chooses_the_local_transport_once() -> None:
    with environment({"RATCHET_BROKER_URL": "memory://localhost/", "RATCHET_REDIS_URL": NOWHERE}):
        chosen = get_transport()
        assert isinstance(chosen, LocalTransport)
        assert get_transport() is chosen
        get_settings.cache_clear()
        assert get_transport() is chosen  # one per process: its listeners are the process's


def test_a_redis_broker_chooses_redis_with_one_pool_per_url() -> None:
    with environment({"RATCHET_BROKER_URL": NOWHERE, "RATCHET_REDIS_URL": NOWHERE}):
        chosen = get_transport()
        assert isinstance(chosen, RedisTransport)
        get_settings.cache_clear()
        assert get_transport() is chosen  # same URLs: same clients, same publisher thread
        client = chosen.limiter().client
        assert chosen.presence("q").client is client
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == COMMAND_TIMEOUT_SECONDS
        assert kwargs["socket_connect_timeout"] == CONNECT_TIMEOUT_SECONDS


def test_a_broker_other_than_redis_is_not_looked_into_and_has_no_gate() -> None:
    transport = transport_for(Settings(broker_url="amqp://127.0.0.1:1//", redis_url=NOWHERE))
    assert isinstance(transport, RedisTransport)
    assert transport.queue_depth("q") is None
    assert transport.oldest_message("q") is None
    assert transport.reset_gate("gate", 5, ttl_seconds=60) == 0
    assert not transport.take_gate_slot("gate")


def test_the_local_gate_lets_in_its_slots_until_it_closes() -> None:
    transport = LocalTransport()
    assert not transport.take_gate_slot("gate")  # never opened
    assert transport.reset_gate("gate", 2, ttl_seconds=60) == 0
    assert [transport.take_gate_slot("gate") for _ in range(3)] == [True, True, False]
    assert transport.reset_gate("gate", 2, ttl_seconds=60) == 2  # taken, not landed
    transport.land_gate_slot("gate")
    assert transport.reset_gate("gate", 0, ttl_seconds=60) == 1  # closed
    assert not transport.take_gate_slot("gate")
    for _ in range(3):  # never below none
        transport.land_gate_slot("gate")
    assert transport.reset_gate("gate", 2, ttl_seconds=0.01) == 0
    time.sleep(0.02)
    assert not transport.take_gate_slot("gate")  # closed by itself


def test_the_local_live_view_drops_expired_records_and_lists_the_newest_first() -> None:
    presence = LocalTransport().presence("q")
    presence.put("old", "a", seen_at=1.0, ttl_seconds=60)
    presence.put("new", "b", seen_at=2.0, ttl_seconds=60)
    presence.put("gone", "c", seen_at=3.0, ttl_seconds=0)
    assert presence.records(10) == ["b", "a"]
    assert presence.records(1) == ["b"]
    presence.remove("new")
    assert presence.records(10) == ["a"]


def test_local_wake_ups_reach_their_listeners_in_this_process() -> None:
    transport = LocalTransport()
    cancelled: list[str] = []
    transport.follow_cancels(cancelled.append, log=LOG)
    transport.wake_cancel("t-1")
    assert cancelled == ["t-1"]

    waiter = transport.dispatcher_waiter("q")
    assert not waiter.wait(0)
    transport.wake_dispatcher("q")
    assert waiter.wait(0)
    assert not waiter.wait(0)  # one wake-up answers one round

    async def follow() -> list[str]:
        woken: list[str] = []
        following = transport.follow_readers(woken.append, wake_all=lambda: None, log=LOG)
        await asyncio.to_thread(transport.wake_readers, ["t-1", "t-2"])  # from another thread
        await asyncio.sleep(0)  # the wake-ups are handed to this loop
        await following.stop()
        transport.wake_readers(["t-3"])  # after stop: nobody listens
        await asyncio.sleep(0)
        return woken

    assert asyncio.run(follow()) == ["t-1", "t-2"]
