"""A cancel reaches a step in flight even when its wake-up is lost: the heartbeat sees it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shared.store import tasks
from shared.store.db import transaction
from tests.conftest import Configure, TenantHandle
from tests.helpers import scripted_task
from tests.integration.test_durability import submit, task_row
from workers.providers.scripted import ScriptedProvider
from workers.steps import runner

pytestmark = pytest.mark.backends("postgresql", "sqlite")

LONG = 60.0


@pytest.fixture
def short_leases(configure: Configure) -> None:
    """Leases of 0.9 s: the heartbeat extends each one (and looks at its task) every 0.3 s."""
    configure(RATCHET_LEASE_TTL_SECONDS="0.9")


def test_the_heartbeat_wakes_a_step_whose_cancel_was_not_published(
    client: TestClient,
    tenant: TenantHandle,
    monkeypatch: pytest.MonkeyPatch,
    short_leases: None,
) -> None:
    thinking, release = threading.Event(), threading.Event()
    complete = ScriptedProvider.complete

    def hangs(self: ScriptedProvider, request: Any) -> Any:
        thinking.set()
        release.wait(LONG)
        return complete(self, request)

    monkeypatch.setattr(ScriptedProvider, "complete", hangs)
    task_id = submit(client, tenant, scripted_task([{"content": "too late"}]))
    step = threading.Thread(target=runner.advance, args=(task_id, 1))
    step.start()
    assert thinking.wait(LONG)

    # Flagged in the database only, as when the API's wake-up never reached this worker.
    with transaction() as session:
        tasks.request_cancel(session, tenant.id, task_id)
    step.join(timeout=LONG)

    stopped_waiting = not step.is_alive() and not release.is_set()
    release.set()
    assert stopped_waiting  # the step ended while its model call still hung
    task = task_row(task_id)
    assert (task.status, task.error["type"]) == ("cancelled", "cancelled")  # type: ignore[index]
    assert task.cancel_requested_at is None
