"""Schedules are bounded on both backends: a tenant's count, the size of a schedule's task,
how often its cron may fire; and a list of them comes a page at a time (the API's and the
CLI's), each schedule once."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from typer.testing import CliRunner

from api import submission
from api.schemas.tasks import TaskCreate
from ratchet import cli_schedules
from ratchet import client as ratchet_client
from ratchet.cli import app as cli
from ratchet.cli import describe
from shared.errors import Conflict
from shared.scheduling import schedules
from shared.settings import get_settings
from shared.store.db import transaction
from shared.store.tables import Schedule
from tests.conftest import TenantHandle
from tests.helpers import scripted_task
from tests.integration.test_scheduling import ANSWER, settings

pytestmark = pytest.mark.backends("postgresql", "sqlite")


def create(
    client: TestClient, tenant: TenantHandle, name: str, **extra: Any
) -> Any:  # the response
    body = {"name": name, "cron": "0 3 * * *", "task": scripted_task(ANSWER)} | extra
    return client.post("/v1/schedules", json=body, headers=tenant.headers)


def count(tenant: TenantHandle) -> int:
    with transaction() as session:
        query = select(func.count()).select_from(Schedule).where(Schedule.tenant_id == tenant.id)
        return int(session.scalar(query) or 0)


def assert_problem(response: Any, status: int, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem: dict[str, Any] = response.json()
    for word in words:
        assert word in problem["detail"], problem
    return problem


def test_past_its_most_schedules_a_tenant_is_refused_and_others_are_not(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    tenant, other = make_tenant(), make_tenant()
    with settings(max_schedules_per_tenant=3):
        for n in range(3):
            assert create(client, tenant, f"s{n}").status_code == 201
        assert_problem(create(client, tenant, "s3"), 409, "3 schedules", "(3)")
        assert count(tenant) == 3
        assert create(client, other, "s0").status_code == 201  # a cap of its own
        first = client.get("/v1/schedules", headers=tenant.headers).json()["items"][0]
        client.delete(f"/v1/schedules/{first['id']}", headers=tenant.headers)
        assert create(client, tenant, "s3").status_code == 201  # room again


@pytest.mark.backends("postgresql")
def test_concurrent_creations_never_take_a_tenant_past_its_most(tenant: TenantHandle) -> None:
    spec = submission.resolve(TaskCreate.model_validate(scripted_task(ANSWER)), get_settings())

    def one(n: int) -> bool:
        try:
            with transaction() as session:
                schedules.create(
                    session,
                    tenant.id,
                    name=f"race-{n}",
                    cron="0 3 * * *",
                    timezone="UTC",
                    spec=spec,
                    request={"input": "run the script"},
                    catch_up="run_once",
                    created_by="test",
                )
            return True
        except Conflict:
            return False

    with settings(max_schedules_per_tenant=4), ThreadPoolExecutor(8) as pool:
        created = sum(pool.map(one, range(16)))
    assert (created, count(tenant)) == (4, 4)


def test_a_schedules_task_larger_than_the_most_is_refused(
    client: TestClient, tenant: TenantHandle
) -> None:
    with settings(schedule_max_task_bytes=2048):
        big = scripted_task(ANSWER, input="x" * 3000)
        problem = assert_problem(create(client, tenant, "big", task=big), 422, "2048 bytes")
        assert problem["errors"][0]["field"] == "task"
        small = scripted_task(ANSWER, input="x" * 1000)
        assert create(client, tenant, "small", task=small).status_code == 201
    assert count(tenant) == 1


@pytest.mark.parametrize(
    ("cron", "least", "fires_every"),
    [
        ("*/5 * * * * *", 60, 1),  # seconds last: every second of every fifth minute
        ("* * * * * */2", 60, 2),
        ("* * * * * 0,30", 60, 30),
        ("0 * * * * *", 60, 1),  # every second of minute 0, not once a minute
        ("*/2 * * * *", 300, 120),  # the operator raised the minimum
        ("0,59 0,23 * * *", 120, 60),  # 23:59 then 00:00 the next day
    ],
)
def test_a_cron_firing_more_often_than_the_minimum_is_refused_naming_it(
    client: TestClient, tenant: TenantHandle, cron: str, least: int, fires_every: int
) -> None:
    with settings(schedule_min_interval_seconds=least):
        response = create(client, tenant, "often", cron=cron)
    problem = assert_problem(response, 422, f"{fires_every} s apart", f"is {least} s", "second")
    assert problem["errors"][0]["field"] == "cron"
    assert count(tenant) == 0


@pytest.mark.parametrize(
    ("cron", "least"),
    [
        ("* * * * *", 60),  # every minute: the default minimum
        ("* * * * * 30", 60),  # second 30 of every minute
        ("*/5 * * * *", 300),
        ("0 9 * * 1-5", 3600),
        ("* * * * * */2", 1),  # the operator lowered the minimum
        ("* * * * * *", 0),  # ... or lifted it
    ],
)
def test_a_cron_at_or_past_the_minimum_is_taken(
    client: TestClient, tenant: TenantHandle, cron: str, least: int
) -> None:
    with settings(schedule_min_interval_seconds=least):
        assert create(client, tenant, "ok", cron=cron).status_code == 201


def test_the_list_comes_a_page_at_a_time_each_schedule_once(
    client: TestClient, tenant: TenantHandle, make_tenant: Callable[..., TenantHandle]
) -> None:
    names = [f"s{n:02d}" for n in range(7)]
    for name in reversed(names):
        assert create(client, tenant, name).status_code == 201
    create(client, make_tenant(), "s03")  # another tenant's: never on this one's pages
    seen, cursor, pages = [], None, 0
    while True:
        params = {"limit": 3} | ({"cursor": cursor} if cursor else {})
        page = client.get("/v1/schedules", params=params, headers=tenant.headers).json()
        assert len(page["items"]) <= 3
        seen += [s["name"] for s in page["items"]]
        pages, cursor = pages + 1, page["next_cursor"]
        if cursor is None:
            break
    assert (seen, pages) == (names, 3)
    whole = client.get("/v1/schedules", headers=tenant.headers).json()  # the shape as before
    assert ([s["name"] for s in whole["items"]], whole["next_cursor"]) == (names, None)
    bad = client.get("/v1/schedules", params={"cursor": "a\x01"}, headers=tenant.headers)
    assert assert_problem(bad, 422)["errors"][0]["field"] == "cursor"
    too_many = client.get("/v1/schedules", params={"limit": 101}, headers=tenant.headers)
    assert too_many.status_code == 422


def over_http(client: TestClient, tenant: TenantHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ratchet schedules`` (an HTTP client of the API) talks to this app, with the key."""

    def api_client() -> ratchet_client.Client:
        through = ratchet_client.Client("http://testserver", tenant.key)
        through._http = TestClient(client.app, headers=tenant.headers)
        return through

    monkeypatch.setattr(cli_schedules, "api_client", api_client)


def test_the_cli_lists_every_schedule_through_its_pages(
    client: TestClient, tenant: TenantHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = [f"s{n}" for n in range(5)]
    for name in names:
        assert create(client, tenant, name).status_code == 201
    over_http(client, tenant, monkeypatch)
    monkeypatch.setattr(ratchet_client, "SCHEDULES_PAGE", 2)
    result = CliRunner().invoke(cli, ["schedules", "list"])
    assert result.exit_code == 0, result.output
    assert [s["name"] for s in json.loads(result.stdout)] == names


def test_the_cli_refuses_a_seconds_cron_naming_the_field(
    client: TestClient, tenant: TenantHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    over_http(client, tenant, monkeypatch)
    task = json.dumps(scripted_task(ANSWER))
    args = ["schedules", "add", "every-5", "--task", task]
    result = CliRunner().invoke(cli, [*args, "--cron", "*/5 * * * * *"])
    assert result.exit_code != 0
    told = describe(result.exception) if result.exception else result.output  # the one line
    assert "422" in told
    assert "60 s" in told
    assert "the last, for the second" in told
    assert count(tenant) == 0
    helped = CliRunner().invoke(cli, ["schedules", "add", "--help"], terminal_width=200)
    assert "for the second" in helped.output
