"""The thread page and the live task page in a real browser, against a real API and worker.

A thread's turns are shown as a transcript (user messages, the model's answers, tool calls
and their outcomes, each turn linked to its task), hostile text in it stays text, another
tenant's thread is not found, and a turn whose model streams slowly shows its answer being
written — on its task page and on its thread page — before the step commits, then the
committed answer in its place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, StorageState, expect

from tests.browser.conftest import TenantFactory
from tests.conftest import TenantHandle
from tests.e2e.conftest import Stack
from tests.e2e.util import wait_all
from tests.helpers import tool_turn

HOSTILE = "<script>window.pwned = 1</script><img src=x onerror='window.pwned = 2'>"
# Spread over its words by the scripted model: long enough that a page sees it part-written.
SLOW_ANSWER = " ".join(f"word{i}" for i in range(1, 41))
SLOW_MS = 20_000


def turn(script: list[dict[str, Any]], message: str) -> dict[str, Any]:
    return {"input": message, "model": "scripted", "model_options": {"script": script}}


def send(http: httpx.Client, thread_id: str, body: dict[str, Any]) -> str:
    response = http.post(f"/v1/threads/{thread_id}/runs", json=body)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def new_thread(http: httpx.Client, **metadata: str) -> str:
    response = http.post("/v1/threads", json={"agent": "default", "metadata": metadata})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def status_of(page: Page, path: str) -> int:
    response = page.goto(path)
    assert response is not None
    return response.status


@pytest.fixture(scope="module")
def tenant(make_tenant: TenantFactory) -> TenantHandle:
    from shared.store.tenants import DEFAULT_SCOPES

    return make_tenant(scopes=(*DEFAULT_SCOPES, "admin"))  # its key sends turns and logs in


@pytest.fixture
def http(stack: Stack, tenant: TenantHandle) -> Iterator[httpx.Client]:
    with stack.client(tenant.headers) as client:
        yield client


@pytest.fixture(scope="module")
def two_turns(stack: Stack, tenant: TenantHandle) -> tuple[str, list[str]]:
    """A finished thread of two turns: a calculator call then an answer, the first turn's
    message hostile markup."""
    with stack.client(tenant.headers) as http:
        thread_id = new_thread(http, customer="42")
        calc = [tool_turn("calculator", expression="6*7"), {"content": "It is 42."}]
        first = send(http, thread_id, turn(calc, HOSTILE))
        second = send(http, thread_id, turn([{"content": "Twice that: 84."}], "And twice?"))
        finished = wait_all(http, None, [first, second])
        assert {t["status"] for t in finished.values()} == {"succeeded"}, finished
    return thread_id, [first, second]


@pytest.fixture
def operator_page(open_page: Callable[..., Page], operator_session: StorageState) -> Page:
    return open_page(operator_session)


def test_the_thread_page_shows_the_transcript_and_links_each_turn_to_its_task(
    login: Callable[[str], Page], tenant: TenantHandle, two_turns: tuple[str, list[str]]
) -> None:
    thread_id, tasks = two_turns
    page = login(tenant.key)
    page.goto("/dashboard/threads?metadata=customer:42")
    page.locator(f"tr[data-thread='{thread_id}'] a").first.click()
    expect(page).to_have_url(f"{page.url.split('/dashboard')[0]}/dashboard/threads/{thread_id}")

    turns = page.locator("li.turn")
    expect(turns).to_have_count(2)
    first, second = turns.nth(0), turns.nth(1)
    # The hostile message is shown as the text it is, and nothing in it ran.
    expect(first.locator(".msg.user pre")).to_have_text(HOSTILE)
    assert page.evaluate("window.pwned") is None
    assert page.locator("li.turn img, li.turn script").count() == 0
    # The model's tool call, its arguments and outcome, then the answers.
    expect(first.locator(".msg.tool")).to_contain_text("calculator")
    expect(first.locator(".msg.tool")).to_contain_text('"6*7"')
    expect(first.locator(".msg.tool")).to_contain_text("42")
    expect(first.locator(".msg.assistant pre").last).to_have_text("It is 42.")
    expect(second.locator(".msg.user pre")).to_have_text("And twice?")
    expect(second.locator(".msg.assistant pre")).to_have_text("Twice that: 84.")
    expect(page.locator("#thread-status")).to_have_text("idle")

    # Each turn links to its task, whose page links back to the thread.
    second.locator("a.turn-task").click()
    expect(page).to_have_url(f"{page.url.split('/dashboard')[0]}/dashboard/tasks/{tasks[1]}")
    expect(page.locator("#task-state")).to_have_text("succeeded")
    page.get_by_role("link", name=thread_id).click()
    expect(page.locator("li.turn")).to_have_count(2)


def test_another_tenants_thread_is_not_found(
    login: Callable[[str], Page],
    make_tenant: TenantFactory,
    two_turns: tuple[str, list[str]],
    operator_page: Page,
) -> None:
    thread_id, _ = two_turns
    page = login(make_tenant(scopes=("admin",)).key)
    assert status_of(page, f"/dashboard/threads/{thread_id}") == 404
    expect(page.get_by_role("alert")).to_have_text(f"no thread {thread_id}")
    page.goto("/dashboard/threads")
    expect(page.locator(f"tr[data-thread='{thread_id}']")).to_have_count(0)
    # Nor can it follow the other tenant's turns' event streams.
    _, tasks = two_turns
    assert status_of(page, f"/dashboard/tasks/{tasks[0]}/events") == 404

    # The operator sees every tenant's threads.
    assert status_of(operator_page, f"/dashboard/threads/{thread_id}") == 200
    expect(operator_page.locator("li.turn")).to_have_count(2)


def test_a_streaming_answer_shows_as_it_is_written_then_as_committed(
    login: Callable[[str], Page],
    tenant: TenantHandle,
    http: httpx.Client,
) -> None:
    thread_id = new_thread(http)
    task_page = login(tenant.key)
    thread_page = login(tenant.key)
    task_id = send(http, thread_id, turn([{"content": SLOW_ANSWER, "delay_ms": SLOW_MS}], "Go"))
    task_page.goto(f"/dashboard/tasks/{task_id}")
    thread_page.goto(f"/dashboard/threads/{thread_id}")
    for page in (task_page, thread_page):
        page.evaluate("window.sameDocument = true")  # gone if the page is ever reloaded

    # Each page shows a part of the answer, in order, while the step is not committed.
    for page in (task_page, thread_page):
        partial = page.locator("[data-partial] pre")
        expect(partial).to_contain_text("word1 ")
        shown = partial.text_content() or ""
        assert SLOW_ANSWER.startswith(shown), shown
        assert len(shown) < len(SLOW_ANSWER), shown
    assert http.get(f"/v1/tasks/{task_id}").json()["status"] == "running"

    # Then the committed answer, whole, in place of the partial one.
    for page in (task_page, thread_page):
        expect(page.locator(".msg.assistant:not(.partial) pre").last).to_have_text(
            SLOW_ANSWER, timeout=SLOW_MS * 3
        )
        expect(page.locator("[data-partial]")).to_have_count(0)
        assert page.evaluate("window.sameDocument") is True
    assert wait_all(http, None, [task_id])[task_id]["status"] == "succeeded"
