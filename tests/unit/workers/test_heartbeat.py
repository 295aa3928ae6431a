"""A lease is held while its heartbeat keeps it fresh, counted from when it was taken; a stale
one is held again once the heartbeat extends it, and not once lost or never extended (no
services needed: the heartbeat's statement is replaced here)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from shared.store.leases import Lease
from workers import heartbeat


def lease(ttl_ms: int = 3_000, *, taken_ago: float = 0.0) -> Lease:
    return Lease(
        task_id="t",
        epoch=1,
        owner="w",
        step=1,
        attempt=1,
        ttl_ms=ttl_ms,
        taken_at=time.monotonic() - taken_ago,
    )


@pytest.fixture
def no_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """No heartbeat extends a lease here but the test's own: none is started, and one that an
    earlier test of this process started (on its database) is letting its leases go."""
    monkeypatch.setattr(heartbeat, "_ensure_thread", lambda: None)
    letting_go = threading.Event()
    letting_go.set()
    monkeypatch.setattr(heartbeat, "_letting_go", letting_go)


@pytest.mark.usefixtures("no_heartbeat")
def test_a_lease_is_held_while_kept_and_fresh_and_not_once_lost() -> None:
    held = lease()
    assert heartbeat.holding(held)  # a step run outside a worker: taken at its word
    with heartbeat.kept(held):
        assert heartbeat.holding(held)
        entry = heartbeat._leases[id(held)]
        heartbeat._leases[id(held)] = (held, entry[1], heartbeat.LOST)
        assert not heartbeat.holding(held)
    assert id(held) not in heartbeat._leases  # let go when its step ends


@pytest.mark.usefixtures("no_heartbeat")
def test_a_lease_taken_long_before_its_step_got_here_is_not_held_unless_extended() -> None:
    # Taken 0.3 s ago with a TTL of 0.4 s: past half of it before its step even asked to keep
    # it (a cold process reading its context on a busy machine). Nothing extends it here.
    stale = lease(ttl_ms=400, taken_ago=0.3)
    with heartbeat.kept(stale):
        asked = time.monotonic()
        assert not heartbeat.holding(stale)
        # It waited for the heartbeat's answer (half a TTL at most) before giving up.
        assert time.monotonic() - asked >= 0.2 - 0.01


@pytest.mark.usefixtures("no_heartbeat")
def test_a_stale_lease_the_heartbeat_extends_is_held_and_one_it_finds_lost_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    extended: list[list[str]] = []

    def statement(leases: list[Lease]) -> set[tuple[str, int]]:
        extended.append([lease.task_id for lease in leases])
        return {(lease.task_id, lease.epoch) for lease in leases if lease.task_id == "kept"}

    # The heartbeat's statement, answered here: "kept" is still this process's, "gone" is not.
    monkeypatch.setattr(
        heartbeat,
        "extend_leases",
        lambda session, leases, ttl_ms: dict.fromkeys(statement(leases), False),
    )
    monkeypatch.setattr(heartbeat, "write_session", lambda heartbeat: contextlib.nullcontext())
    # Both taken 40 s ago with a TTL of 60 s: stale (past half of it), perhaps still held.
    taken_at = time.monotonic() - 40
    kept, gone = (
        Lease(task_id=name, epoch=1, owner="w", step=1, attempt=1, ttl_ms=60_000, taken_at=taken_at)
        for name in ("kept", "gone")
    )
    stop = threading.Event()

    def tick() -> None:  # the heartbeat thread, as ``_run`` runs it
        while not stop.is_set():
            heartbeat._tick_now.wait(0.05)
            heartbeat._tick_now.clear()
            due = heartbeat._due()
            if due:
                heartbeat.extend(due)

    with heartbeat.kept(kept), heartbeat.kept(gone):
        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            assert heartbeat.holding(kept)
            assert not heartbeat.holding(gone)
        finally:
            stop.set()
            ticker.join(timeout=10)
    assert extended
    assert set(extended[0]) == {"kept", "gone"}
