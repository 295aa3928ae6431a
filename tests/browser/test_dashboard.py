"""The ops dashboard in a real browser, against a real API and worker.

Each test drives the pages as an operator or a tenant admin would (log in, filter, click,
confirm) and checks the outcome through the JSON API as well: the counts the overview shows,
the rows a filter keeps, steps arriving without a reload, a cancel, a bulk retry, an endpoint
disabled and enabled, a key revoked, one tenant's view closed to another, a login refused, a
form without its CSRF token refused, and no secret in any page.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, StorageState, expect

from tests.browser.conftest import PROVIDER_KEYS, WEBHOOK_HOST, TenantFactory
from tests.browser.gates import AGENT, Gates, gate_turn
from tests.conftest import TenantHandle
from tests.e2e.conftest import Stack
from tests.e2e.util import wait_all
from tests.helpers import calculator_script, scripted_task

# A model that never answers: the task fails once its attempts are spent.
BROKEN = [{"error": "server_error", "times": 99}]
# Fails exactly the default RATCHET_MODEL_MAX_ATTEMPTS (5) times, so the task fails; the
# worker's scripted model has counted those failures, so a retry's first call answers.
FAILS_ONCE = [{"error": "server_error", "times": 5, "content": "recovered"}]
# How long the overview may take to agree with the API while the fleet is still moving.
SETTLE_SECONDS = 60.0


@dataclass(frozen=True)
class SeededRun:
    """A finished run of one tenant's tasks, all tagged ``run:<tag>``."""

    tenant: TenantHandle
    tag: str
    ids: dict[str, list[str]]  # by final status

    @property
    def metadata(self) -> str:
        return f"run:{self.tag}"


def submit(http: httpx.Client, body: dict[str, Any]) -> str:
    response = http.post("/v1/tasks", json=body)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def task_of(http: httpx.Client, task_id: str) -> dict[str, Any]:
    response = http.get(f"/v1/tasks/{task_id}")
    assert response.status_code == 200, response.text
    return dict(response.json())


def event_types(http: httpx.Client, task_id: str) -> list[str]:
    """The events of a task that has ended (its stream ends with it)."""
    lines = http.get(f"/v1/tasks/{task_id}/events").text.splitlines()
    return [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]


def wait_running(http: httpx.Client, task_id: str, timeout: float = 60.0) -> None:
    """Until the task's gate holds it: running, its first step in flight."""
    deadline = time.monotonic() + timeout
    while task_of(http, task_id)["status"] != "running":
        assert time.monotonic() < deadline, f"task {task_id} not running after {timeout} s"
        time.sleep(0.1)


def gated(http: httpx.Client, name: str, **extra: Any) -> str:
    """A task held at step 1 until the gate ``name`` opens."""
    body = scripted_task([gate_turn(name), {"content": "through"}], agent=AGENT, **extra)
    return submit(http, body)


def listed_ids(page: Page) -> set[str]:
    """The task ids the task list shows (read at once: a live refresh may swap the rows)."""
    ids = page.locator("tr[data-task]").evaluate_all("rows => rows.map(r => r.dataset.task)")
    return set(ids)


def shown_counts(page: Page) -> dict[str, int]:
    tiles = page.locator("[data-count]").evaluate_all(
        "tiles => tiles.map(t => [t.dataset.count, t.textContent])"
    )
    return {state: int(text.replace(",", "")) for state, text in tiles}


def status_of(page: Page, path: str) -> int:
    """Open ``path``; the status it was answered with."""
    response = page.goto(path)
    assert response is not None
    return response.status


def accept_dialogs(page: Page) -> None:
    """Answer the page's ``data-confirm`` questions with OK."""
    page.on("dialog", lambda dialog: dialog.accept())


@pytest.fixture(scope="module")
def seeded(stack: Stack, make_tenant: TenantFactory) -> SeededRun:
    """Three succeeded, two failed and one cancelled task of a fresh tenant, all finished."""
    tenant = make_tenant()
    tag = uuid.uuid4().hex[:12]
    meta = {"metadata": {"run": tag}}
    http = stack.client(tenant.headers)
    calc = scripted_task(calculator_script(2), tools=["calculator"], **meta)
    ids = {
        "succeeded": [submit(http, calc) for _ in range(3)],
        "failed": [submit(http, scripted_task(BROKEN, **meta)) for _ in range(2)],
        "cancelled": [gated(http, f"never-{tag}", **meta)],
    }
    assert http.post(f"/v1/tasks/{ids['cancelled'][0]}/cancel").status_code == 202
    finished = wait_all(http, None, [i for group in ids.values() for i in group])
    for status, group in ids.items():
        assert {finished[i]["status"] for i in group} == {status}, finished
    return SeededRun(tenant=tenant, tag=tag, ids=ids)


@pytest.fixture
def operator_page(open_page: Callable[..., Page], operator_session: StorageState) -> Page:
    """A page of its own in the operator's session."""
    return open_page(operator_session)


@pytest.fixture
def operator_http(stack: Stack, operator: TenantHandle) -> Iterator[httpx.Client]:
    with stack.client(operator.headers) as http:
        yield http


def test_the_overview_counts_what_the_api_counts_and_draws_its_charts(
    operator_page: Page, operator_http: httpx.Client, seeded: SeededRun
) -> None:
    page = operator_page
    mine = operator_http.get("/v1/admin/overview", params={"tenant": seeded.tenant.name})
    assert {s: n for s, n in mine.json()["states"].items() if n} == {
        status: len(ids) for status, ids in seeded.ids.items()
    }

    # The fleet's numbers, read from the page and from the API until both read the same
    # moment (another module's leftovers may still be moving).
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        expected = operator_http.get("/v1/admin/overview").json()["states"]
        page.goto("/dashboard")
        shown = shown_counts(page)
        if shown == expected or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert shown == expected
    for status, ids in seeded.ids.items():
        assert shown[status] >= len(ids), shown

    charts = page.locator("figure.chart svg")
    expect(charts).to_have_count(2)
    expect(charts.locator("rect").first).to_be_attached()


def test_the_task_list_filters_by_state_and_metadata_and_the_url_keeps_them(
    operator_page: Page, seeded: SeededRun
) -> None:
    page = operator_page
    page.goto("/dashboard/tasks")
    form = page.get_by_role("search", name="Filter tasks")
    form.get_by_label("Metadata").fill(seeded.metadata)
    form.get_by_role("button", name="Filter").click()
    every = {i for ids in seeded.ids.values() for i in ids}
    expect(page.locator("tr[data-task]")).to_have_count(len(every))
    assert listed_ids(page) == every

    form.get_by_label("State").select_option("failed")
    form.get_by_role("button", name="Filter").click()
    expect(page.locator("tr[data-task]")).to_have_count(len(seeded.ids["failed"]))
    assert listed_ids(page) == set(seeded.ids["failed"])
    assert "status=failed" in page.url
    assert "metadata=run%3A" + seeded.tag in page.url

    page.reload()
    expect(page.locator("tr[data-task]")).to_have_count(len(seeded.ids["failed"]))
    assert listed_ids(page) == set(seeded.ids["failed"])
    expect(form.get_by_label("State")).to_have_value("failed")
    expect(form.get_by_label("Metadata")).to_have_value(seeded.metadata)

    # By state alone: every row shown is in that state, the run's among them.
    page.goto("/dashboard/tasks?status=succeeded")
    expect(page.locator("tr[data-task] .state").first).to_be_visible()
    states = page.locator("tr[data-task] .state").all_inner_texts()
    assert set(states) == {"succeeded"}, states
    assert set(seeded.ids["succeeded"]) <= listed_ids(page)


def test_a_running_tasks_steps_arrive_without_a_reload(
    operator_page: Page, stack: Stack, seeded: SeededRun, gates: Gates
) -> None:
    page = operator_page
    first, second = (f"step-{uuid.uuid4().hex}" for _ in range(2))
    script = [gate_turn(first), gate_turn(second), {"content": "all through"}]
    with stack.client(seeded.tenant.headers) as http:
        task_id = submit(http, scripted_task(script, agent=AGENT))
        page.goto(f"/dashboard/tasks/{task_id}")
        page.evaluate("window.sameDocument = true")  # gone if the page is ever reloaded
        steps = page.locator("li.step")

        expect(steps).to_have_count(1)  # its gate holds step 1
        gates.open(first)
        expect(steps).to_have_count(2)
        gates.open(second)
        expect(steps).to_have_count(3)
        expect(page.locator("#task-state")).to_have_text("succeeded")
        assert page.evaluate("window.sameDocument") is True
        assert task_of(http, task_id)["status"] == "succeeded"


def test_cancel_from_the_task_page_cancels_the_task(
    operator_page: Page, stack: Stack, seeded: SeededRun
) -> None:
    page = operator_page
    with stack.client(seeded.tenant.headers) as http:
        task_id = gated(http, f"cancel-{uuid.uuid4().hex}")
        wait_running(http, task_id)
        page.goto(f"/dashboard/tasks/{task_id}")
        expect(page.locator("#task-state")).to_contain_text("running")

        accept_dialogs(page)
        page.get_by_role("button", name="Cancel task").click()

        expect(page.locator(".flash")).to_have_text("Cancellation requested")
        expect(page.locator("#task-state")).to_have_text("cancelled")
        assert wait_all(http, None, [task_id])[task_id]["status"] == "cancelled"


def test_bulk_retry_of_a_filter_retries_exactly_the_failed_tasks_it_matches(
    operator_page: Page, stack: Stack, seeded: SeededRun
) -> None:
    page = operator_page
    tag = uuid.uuid4().hex[:12]
    with stack.client(seeded.tenant.headers) as http:
        tagged = {"metadata": {"retry": tag}}
        matched = [submit(http, scripted_task(FAILS_ONCE, **tagged)) for _ in range(2)]
        done = submit(http, scripted_task([{"content": "fine"}], **tagged))
        others = [submit(http, scripted_task(FAILS_ONCE)) for _ in range(2)]
        before = wait_all(http, None, [*matched, done, *others])
        assert [before[i]["status"] for i in [*matched, done, *others]] == [
            *["failed"] * 2,
            "succeeded",
            *["failed"] * 2,
        ]

        page.goto(f"/dashboard/tasks?metadata=retry:{tag}")
        expect(page.locator("tr[data-task]")).to_have_count(3)
        page.get_by_role("button", name="Retry all matching").click()
        expect(page.locator("[data-count=confirm]")).to_have_text(str(len(matched)))
        page.get_by_role("button", name=f"Yes, retry {len(matched)} task(s)").click()
        expect(page.locator(".flash")).to_have_text(f"Retried {len(matched)} task(s)")

        after = wait_all(http, None, [*matched, done, *others])
        for task_id in matched:  # retried: queued again, and this time it answered
            assert after[task_id]["status"] == "succeeded", after[task_id]
            assert event_types(http, task_id).count("task.queued") == 2
        for task_id in [done, *others]:  # untouched
            assert after[task_id]["status"] == before[task_id]["status"]
            assert event_types(http, task_id).count("task.queued") == 1


def test_a_webhook_endpoint_is_disabled_and_enabled_again(
    operator_page: Page, stack: Stack, make_tenant: TenantFactory
) -> None:
    page = operator_page
    owner = make_tenant(scopes=("admin",))
    with stack.client(owner.headers) as http:
        created = http.post(
            "/v1/webhook-endpoints", json={"url": f"https://{WEBHOOK_HOST}/ratchet"}
        )
        assert created.status_code == 201, created.text
        endpoint = created.json()["id"]

        def enabled() -> bool:
            return bool(http.get(f"/v1/webhook-endpoints/{endpoint}").json()["enabled"])

        page.goto("/dashboard/webhooks")
        row = page.locator(f"tr[data-endpoint='{endpoint}']")
        expect(row).to_contain_text("enabled")

        row.get_by_role("button", name="Disable").click()
        expect(page.locator(".flash")).to_have_text("Endpoint disabled")
        expect(row).to_contain_text("disabled from the dashboard")
        assert not enabled()

        row.get_by_role("button", name="Enable").click()
        expect(page.locator(".flash")).to_have_text("Endpoint enabled")
        expect(row.get_by_role("button", name="Disable")).to_be_visible()
        assert enabled()


def test_a_key_revoked_on_the_keys_page_is_refused_by_the_api(
    operator_page: Page, stack: Stack, operator: TenantHandle
) -> None:
    from shared.store.db import transaction
    from shared.store.tenants import issue_key

    with transaction() as session:
        row, key = issue_key(session, operator.id, name="doomed")
    with stack.client({"Authorization": f"Bearer {key}"}) as http:
        assert http.get("/v1/tasks").status_code == 200

        page = operator_page
        page.goto("/dashboard/tenants")
        key_row = page.locator(f"tr[data-key='{row.id}']")
        expect(key_row).to_contain_text("active")
        accept_dialogs(page)
        key_row.get_by_role("button", name="Revoke").click()

        expect(page.locator(".flash")).to_contain_text("revoked")
        expect(key_row).to_contain_text("revoked")
        assert http.get("/v1/tasks").status_code == 401


def test_a_tenant_admin_sees_only_its_own_tenant(
    login: Callable[[str], Page], stack: Stack, make_tenant: TenantFactory, seeded: SeededRun
) -> None:
    admin = make_tenant(scopes=("admin",))
    foreign = seeded.ids["succeeded"][0]
    with stack.client(admin.headers) as http:
        own = submit(http, scripted_task([{"content": "mine"}]))
        wait_all(http, None, [own])
        page = login(admin.key)

        # Its overview counts its own tenant's tasks alone.
        expect(page.locator("[data-count=succeeded]")).to_have_text("1")
        assert shown_counts(page) == http.get("/v1/overview").json()["states"]

    # Its task list leaves the other tenant's tasks out, whatever the filter asks for.
    page.goto(f"/dashboard/tasks?tenant={seeded.tenant.name}")
    expect(page.locator(f"tr[data-task='{own}']")).to_have_count(1)
    assert foreign not in listed_ids(page)
    page.goto(f"/dashboard/tasks?id={foreign}")
    expect(page.get_by_text("No task matches this filter.")).to_be_visible()

    # The other tenant's task page is not found; the fleet's page is the operator's.
    assert status_of(page, f"/dashboard/tasks/{foreign}") == 404
    expect(page.get_by_role("alert")).to_have_text(f"no task {foreign}")
    assert seeded.tenant.name not in page.content()
    assert status_of(page, f"/dashboard/tasks/{own}") == 200
    assert status_of(page, "/dashboard/workers") == 403


def test_a_key_that_may_only_read_tasks_cannot_log_in(
    open_page: Callable[..., Page], stack: Stack, make_tenant: TenantFactory
) -> None:
    reader = make_tenant(scopes=("tasks:read",))
    page = open_page()
    page.goto("/dashboard/login")
    page.fill("#key", reader.key)
    page.get_by_role("button", name="Log in").click()

    expect(page.get_by_role("alert")).to_contain_text("cannot open the dashboard")
    expect(page).to_have_url(f"{stack.url}/dashboard/login")
    assert page.context.cookies() == []
    page.goto("/dashboard")
    expect(page).to_have_url(f"{stack.url}/dashboard/login?next=/dashboard")


def test_an_action_without_its_csrf_token_or_from_another_site_is_refused(
    operator_page: Page, stack: Stack, seeded: SeededRun
) -> None:
    page = operator_page
    with stack.client(seeded.tenant.headers) as http:
        task_id = gated(http, f"csrf-{uuid.uuid4().hex}")
        wait_running(http, task_id)
        page.goto(f"/dashboard/tasks/{task_id}")
        action = f"/dashboard/tasks/{task_id}/cancel"

        token = page.locator(f"form[action='{action}'] input[name=csrf_token]").input_value()

        # The session cookie goes with each of these; the token is missing or wrong, or the
        # right token comes from another site.
        forged = [
            ({}, {}),
            ({"csrf_token": "not-the-token"}, {}),
            ({"csrf_token": token}, {"Origin": "https://elsewhere.example"}),
        ]
        for form, headers in forged:
            refused = page.request.post(action, form=form, headers=headers, max_redirects=0)
            assert refused.status == 403, (form, headers, refused.status)
        task = task_of(http, task_id)
        assert task["status"] == "running", task
        assert task["cancel_requested_at"] is None, task

        # The page's own request goes through: the refusals were the token's and the origin's.
        accepted = page.request.post(action, form={"csrf_token": token}, max_redirects=0)
        assert accepted.status == 303, accepted.status
        assert wait_all(http, None, [task_id])[task_id]["status"] == "cancelled"


def test_no_page_shows_a_key_or_a_secret(
    operator_page: Page,
    open_page: Callable[..., Page],
    stack: Stack,
    operator: TenantHandle,
    seeded: SeededRun,
) -> None:
    from sqlalchemy import select

    from shared.store.db import transaction
    from shared.store.tables import WebhookSecret
    from shared.webhooks import secrets

    with transaction() as session:
        secrets.current(session, operator.id)  # made if missing, like `ratchet webhooks secret`
        signing = session.scalars(select(WebhookSecret.secret)).all()
    hidden = {
        "the operator's API key": operator.key,
        "the seeded tenant's API key": seeded.tenant.key,
        **{f"a webhook signing secret ({s[:6]}…)": s for s in signing},
        **PROVIDER_KEYS,
    }
    page = operator_page
    page.goto("/dashboard")
    links = page.locator("header nav a").evaluate_all("links => links.map(a => a.pathname)")
    paths = [
        *links,
        "/dashboard?window=24h",
        f"/dashboard/tasks?metadata={seeded.metadata}",
        *(f"/dashboard/tasks/{ids[0]}" for ids in seeded.ids.values()),
    ]
    assert len(links) >= 6, links
    pages = {}
    for path in paths:
        response = page.goto(path)
        assert response is not None
        assert response.status == 200, path
        pages[path] = response.text()
    page.goto(f"/dashboard/tasks?metadata={seeded.metadata}")
    page.get_by_role("button", name="Retry all matching").click()
    expect(page.locator("[data-count=confirm]")).to_be_visible()
    pages["the bulk confirmation"] = page.content()
    response = open_page().goto("/dashboard/login")
    assert response is not None
    pages["/dashboard/login"] = response.text()

    for path, html in pages.items():
        for what, secret in hidden.items():
            assert secret not in html, f"{path} shows {what}"

    # The session is an HttpOnly cookie, not the key: the page's own script cannot read it.
    (cookie,) = page.context.cookies()
    assert cookie["httpOnly"], cookie
    assert cookie["sameSite"] == "Strict", cookie
    assert operator.key not in cookie["value"]
    assert page.evaluate("document.cookie") == ""
