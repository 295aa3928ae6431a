"""Browser tests of the dashboard: one real stack and one Chromium per module.

``stack`` is the e2e harness's :class:`~tests.e2e.conftest.Stack` (a ``ratchet api`` and one
``ratchet worker`` process) on this run's PostgreSQL and Redis, with a provider key in its
environment (which no page may show) and the ``gated`` agent of :mod:`tests.browser.gates`.
``browser`` is the system's Chromium, headless; ``login(key)`` opens a fresh browser context
(cookies of its own) and logs in, ``open_page()`` opens one without logging in::

    def test_something(stack, login, operator):
        page = login(operator.key)
        page.goto("/dashboard/tasks")

Playwright never downloads a browser here: without ``/usr/bin/chromium`` the tests are
skipped locally and fail when CI=true.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from playwright.sync_api import (
    Browser,
    BrowserContext,
    Page,
    StorageState,
    expect,
    sync_playwright,
)

from tests.browser.gates import EXTENSION, GATES_ENV, Gates
from tests.conftest import IN_CI, TenantHandle

# The e2e harness's report hook is this directory's hook too: _stack_logs_on_failure reads
# the reports it keeps.
from tests.e2e.conftest import (
    LOG_TAIL_LINES,
    REPORTS,
    ROOT,
    Stack,
    pytest_runtest_makereport,  # noqa: F401
)

CHROMIUM = Path("/usr/bin/chromium")
# Generous: the suite shares a 2-core machine with a worker, an API and the browser.
TIMEOUT_MS = 30_000
# Webhook endpoints may name this host (on the allow-list, so never resolved or reached).
WEBHOOK_HOST = "hooks.example.test"
# Set in the stack's environment; no page may ever show them.
PROVIDER_KEYS = {
    "RATCHET_OPENAI_API_KEY": f"sk-test-{uuid.uuid4().hex}",
    "RATCHET_ANTHROPIC_API_KEY": f"sk-ant-test-{uuid.uuid4().hex}",
}

NO_CHROMIUM = f"the browser tests need Chromium at {CHROMIUM} (apt-get install chromium)"

TenantFactory = Callable[..., TenantHandle]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark this directory's tests ``e2e`` (so, like those, they skip locally without
    PostgreSQL or Redis and fail the run in CI) and, locally, skip them without Chromium (in
    CI the ``browser`` fixture fails them instead)."""
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.e2e)
            if not (CHROMIUM.exists() or IN_CI):
                item.add_marker(pytest.mark.skip(reason=NO_CHROMIUM))


@pytest.fixture(scope="module")
def gates(tmp_path_factory: pytest.TempPathFactory) -> Gates:
    return Gates(tmp_path_factory.mktemp("gates"))


@pytest.fixture(scope="module")
def make_tenant(service_env: dict[str, str]) -> Iterator[TenantFactory]:
    """Create tenants, each with one API key: ``make_tenant(scopes=(...))``. They and their
    tasks are deleted when the module is done."""
    from shared.store.db import transaction
    from shared.store.tables import Tenant
    from shared.store.tenants import DEFAULT_SCOPES, create_key, create_tenant

    created: list[str] = []

    def factory(scopes: tuple[str, ...] = DEFAULT_SCOPES) -> TenantHandle:
        with transaction() as session:
            tenant = create_tenant(session, f"t-{uuid.uuid4().hex[:12]}")
            key = create_key(session, tenant, scopes)
        created.append(tenant.id)
        return TenantHandle(id=tenant.id, name=tenant.name, key=key)

    yield factory
    with transaction() as session:
        for tenant_id in created:
            tenant = session.get(Tenant, tenant_id)
            if tenant is not None:
                session.delete(tenant)


@pytest.fixture(scope="module")
def stack(
    service_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
    gates: Gates,
    make_tenant: TenantFactory,  # set up first, so the tenants outlive the processes
) -> Iterator[Stack]:
    """One API and one worker (one prefork process: a scripted model's injected failures are
    counted in it) on a Celery queue of the module's own."""
    env = {
        **os.environ,
        **service_env,
        "RATCHET_QUEUE_NAME": f"{service_env['RATCHET_QUEUE_NAME']}-{uuid.uuid4().hex[:8]}",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "RATCHET_AGENT_MODULES": f"{service_env['RATCHET_AGENT_MODULES']},{EXTENSION}",
        "RATCHET_WEBHOOK_ALLOWED_HOSTS": f"127.0.0.1,localhost,{WEBHOOK_HOST}",
        GATES_ENV: str(gates.root),
        **PROVIDER_KEYS,
    }
    started = Stack(env=env, log_dir=tmp_path_factory.mktemp("stack"), concurrency=1)
    try:
        started.start(workers=1)
        yield started
    finally:
        gates.open_all()
        started.close()


@pytest.fixture(autouse=True)
def _stack_logs_on_failure(request: pytest.FixtureRequest, stack: Stack) -> Iterator[None]:
    """The tail of every process's log, printed with a failing test."""
    yield
    reports = request.node.stash.get(REPORTS, {})
    if any(report.failed for report in reports.values()):
        print(stack.logs(tail=LOG_TAIL_LINES))


@pytest.fixture(scope="module")
def operator(make_tenant: TenantFactory) -> TenantHandle:
    """A tenant whose key has the ``operator`` scope: the whole fleet's dashboard."""
    return make_tenant(scopes=("operator",))


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"CI=true and {NO_CHROMIUM}")
    expect.set_options(timeout=TIMEOUT_MS)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield launched
        launched.close()


def log_in(page: Page, key: str) -> None:
    """Log in on the login page, as a person would; the page is left on the overview."""
    page.goto("/dashboard/login")
    page.fill("#key", key)
    page.get_by_role("button", name="Log in").click()
    expect(page).to_have_url(re.compile(r"/dashboard$"))


@pytest.fixture
def open_page(browser: Browser, stack: Stack) -> Iterator[Callable[..., Page]]:
    """Open pages, each in a fresh context (no cookies, unless a ``storage_state`` is given)
    whose relative URLs are the stack's; closed after the test."""
    contexts: list[BrowserContext] = []

    def factory(storage_state: StorageState | None = None) -> Page:
        context = browser.new_context(base_url=stack.url, storage_state=storage_state)
        context.set_default_timeout(TIMEOUT_MS)
        contexts.append(context)
        return context.new_page()

    yield factory
    for context in contexts:
        context.close()


@pytest.fixture
def login(open_page: Callable[..., Page]) -> Callable[[str], Page]:
    """Log in with an API key in a fresh context; the page is left on the overview."""

    def factory(key: str) -> Page:
        page = open_page()
        log_in(page, key)
        return page

    return factory


@pytest.fixture(scope="module")
def operator_session(browser: Browser, stack: Stack, operator: TenantHandle) -> StorageState:
    """The operator's session cookie, logged in once for the module: ``open_page(it)``."""
    context = browser.new_context(base_url=stack.url)
    context.set_default_timeout(TIMEOUT_MS)
    try:
        log_in(context.new_page(), operator.key)
        return context.storage_state()
    finally:
        context.close()
