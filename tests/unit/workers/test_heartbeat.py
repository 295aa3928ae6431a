"""A lease is held while its heartbeat keeps it fresh, and not once stale or lost (no services
needed)."""

from __future__ import annotations

import time

import pytest

from shared.store.leases import Lease
from workers import heartbeat


def lease(ttl_ms: int = 3_000) -> Lease:
    return Lease(task_id="t", epoch=1, owner="w", step=1, attempt=1, ttl_ms=ttl_ms)


def test_a_lease_is_held_while_kept_and_fresh_and_not_once_stale_or_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(heartbeat, "_ensure_thread", lambda: None)  # no database here
    held = lease()
    assert heartbeat.holding(held)  # a step run outside a worker: taken at its word
    with heartbeat.kept(held):
        assert heartbeat.holding(held)
        entry = heartbeat._leases[id(held)]
        # Last extended more than half a TTL ago: this process stalled; it may be lost.
        heartbeat._leases[id(held)] = (held, entry[1], time.monotonic() - 1.6)
        assert not heartbeat.holding(held)
        heartbeat._leases[id(held)] = (held, entry[1], heartbeat.LOST)
        assert not heartbeat.holding(held)
    assert id(held) not in heartbeat._leases  # let go when its step ends
