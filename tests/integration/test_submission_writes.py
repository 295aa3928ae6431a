"""What a submission writes on PostgreSQL: without an Idempotency-Key or a queue cap, the task,
its ``task.queued`` event and their webhooks are one statement in autocommit — all of them or
none, and no BEGIN or COMMIT around it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, func, select, text

from tests.conftest import TenantHandle
from tests.integration.test_api import assert_problem

FAIL_MARK = "fail-the-queued-event"


@pytest.fixture
def statements(client: TestClient) -> Iterator[list[tuple[str, bool]]]:
    """Every statement the API sends from here on, each with whether its connection was in
    autocommit: those SQLAlchemy sends and those sent straight through psycopg."""
    from benchmarks.harness.meter import watching_statements
    from shared.store.db import get_engine

    seen: list[tuple[str, bool]] = []

    def observe(connection: Any, sql: str, _values: Any) -> None:
        seen.append((sql, bool(connection.connection.driver_connection.autocommit)))

    with watching_statements(get_engine(), observe):
        yield seen


def test_a_plain_submission_is_one_statement_in_autocommit(
    client: TestClient, tenant: TenantHandle, statements: list[tuple[str, bool]]
) -> None:
    from shared.store.db import transaction
    from shared.store.tables import TaskEvent

    # The first submission reads the limits and the webhook subscriptions into their caches.
    assert client.post("/v1/tasks", json={"input": "warm"}, headers=tenant.headers).is_success
    statements.clear()

    response = client.post("/v1/tasks", json={"input": "hi"}, headers=tenant.headers)

    assert response.status_code == 202, response.text
    assert len(statements) == 1, statements
    sql, autocommit = statements[0]
    assert sql.lstrip().startswith("WITH")
    assert "INSERT INTO task_events" in sql
    assert autocommit
    with transaction() as session:
        events = session.scalars(
            select(TaskEvent.type).where(TaskEvent.task_id == response.json()["id"])
        ).all()
    assert list(events) == ["task.queued"]


def test_a_submission_with_a_key_stays_in_a_transaction(
    client: TestClient, tenant: TenantHandle, statements: list[tuple[str, bool]]
) -> None:
    headers = {**tenant.headers, "Idempotency-Key": "k-1"}

    response = client.post("/v1/tasks", json={"input": "hi"}, headers=headers)

    assert response.status_code == 202, response.text
    assert statements
    assert not any(autocommit for _, autocommit in statements)


@pytest.fixture
def failing_event(client: TestClient) -> Iterator[None]:
    """task_events refuses the queued event of a task whose metadata carries FAIL_MARK."""
    from shared.store.db import get_engine

    with get_engine().begin() as connection:
        connection.execute(
            text(
                "CREATE FUNCTION refuse_marked_event() RETURNS trigger LANGUAGE plpgsql AS $$"
                " BEGIN IF NEW.data->'metadata' ? :mark THEN RAISE EXCEPTION 'refused';"
                " END IF; RETURN NEW; END $$".replace(":mark", f"'{FAIL_MARK}'")
            )
        )
        connection.execute(
            text(
                "CREATE TRIGGER refuse_marked_event BEFORE INSERT ON task_events"
                " FOR EACH ROW EXECUTE FUNCTION refuse_marked_event()"
            )
        )
    try:
        yield
    finally:
        with get_engine().begin() as connection:
            connection.execute(text("DROP TRIGGER refuse_marked_event ON task_events"))
            connection.execute(text("DROP FUNCTION refuse_marked_event()"))


def test_a_task_whose_event_cannot_be_written_is_not_created(
    client: TestClient, tenant: TenantHandle, failing_event: None
) -> None:
    from shared.store.db import transaction
    from shared.store.tables import Task

    assert client.post("/v1/tasks", json={"input": "warm"}, headers=tenant.headers).is_success
    body = {"input": "hi", "metadata": {FAIL_MARK: True}}

    response = client.post("/v1/tasks", json=body, headers=tenant.headers)

    assert_problem(response, 500)
    with transaction() as session:
        count = session.scalar(select(func.count()).where(Task.tenant_id == tenant.id))
    assert count == 1  # the warm-up's alone


def test_a_burst_of_submissions_waits_for_the_pool_not_past_it(
    service_env: dict[str, str], tenant: TenantHandle
) -> None:
    """Submissions take turns at the pool's connections on the event loop: a burst larger
    than the pool never holds more connections at once than the pool keeps (no overflow
    connection opened, and closed, per request), and every submission gets in."""
    import httpx

    from api.main import create_app
    from shared.settings import get_settings
    from shared.store.db import get_engine

    held = peak = 0
    overlapping = threading.Event()

    def checkout(*_: Any) -> None:
        nonlocal held, peak
        held += 1
        peak = max(peak, held)
        if held > 1:
            overlapping.set()
        # The first holder waits for a second (the burst has plenty), then every holder
        # lingers: the submissions overlap whatever the machine's load.
        overlapping.wait(10)
        time.sleep(0.02)

    def checkin(*_: Any) -> None:
        nonlocal held
        held -= 1

    async def burst(count: int) -> list[int]:
        app = create_app()
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
                responses = await asyncio.gather(
                    *(
                        http.post("/v1/tasks", json={"input": f"hi {i}"}, headers=tenant.headers)
                        for i in range(count)
                    )
                )
        return [r.status_code for r in responses]

    pool = get_engine().pool
    event.listen(pool, "checkout", checkout)
    event.listen(pool, "checkin", checkin)
    try:
        statuses = asyncio.run(burst(4 * get_settings().db_pool_size))
    finally:
        event.remove(pool, "checkout", checkout)
        event.remove(pool, "checkin", checkin)

    assert statuses == [202] * (4 * get_settings().db_pool_size)
    assert 1 < peak <= get_settings().db_pool_size
