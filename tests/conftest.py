"""Shared fixtures: a real PostgreSQL database and Redis for the whole run, tenants on demand.

Each run migrates a fresh database of its own and uses a Celery queue name of its own, so runs
never see each other's rows or messages. Without Postgres or Redis the integration and e2e
tests are skipped locally, and fail the run when CI=true.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg
import pytest
import redis
from sqlalchemy.engine import make_url

ADMIN_URL = os.environ.get(
    "RATCHET_TEST_ADMIN_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("RATCHET_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
RUN_ID = uuid.uuid4().hex[:8]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The tests drive tasks with the deterministic `scripted` model, which production keeps off;
# set here, it reaches every process a test starts as well (they inherit this environment).
os.environ["RATCHET_SCRIPTED_MODEL"] = "true"


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _services_missing() -> str | None:
    try:
        psycopg.connect(_libpq(ADMIN_URL), connect_timeout=3).close()
    except psycopg.Error as exc:
        return f"PostgreSQL at {ADMIN_URL} is not reachable: {exc}"
    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=3).ping()
    except redis.RedisError as exc:
        return f"Redis at {REDIS_URL} is not reachable: {exc}"
    return None


MISSING = _services_missing()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = str(item.path)
        if f"{os.sep}integration{os.sep}" in path:
            item.add_marker(pytest.mark.integration)
        if f"{os.sep}e2e{os.sep}" in path:
            item.add_marker(pytest.mark.e2e)
    if MISSING is None:
        return
    needs_services = [i for i in items if "integration" in i.keywords or "e2e" in i.keywords]
    if IN_CI and needs_services:
        raise pytest.UsageError(f"CI=true and {MISSING}: these tests must run in CI")
    for item in needs_services:
        item.add_marker(pytest.mark.skip(reason=MISSING))


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A freshly migrated PostgreSQL database for this run, dropped at the end."""
    if MISSING:
        pytest.skip(MISSING)
    name = f"ratchet_test_{RUN_ID}"
    with psycopg.connect(_libpq(ADMIN_URL), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    from shared.store.db import migrate

    migrate(url)
    yield url
    from shared.store.db import reset_engines

    reset_engines()
    with psycopg.connect(_libpq(ADMIN_URL), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def service_env(database_url: str) -> Iterator[dict[str, str]]:
    """The RATCHET_* environment that points this process and its children at the test services."""
    env = {
        "RATCHET_DATABASE_URL": database_url,
        "RATCHET_REDIS_URL": REDIS_URL,
        "RATCHET_BROKER_URL": REDIS_URL,
        "RATCHET_QUEUE_NAME": f"ratchet-test-{RUN_ID}",
        "RATCHET_HTTP_ALLOWED_HOSTS": "127.0.0.1,localhost",
        "RATCHET_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1,localhost",
        "RATCHET_MODEL_RETRY_BASE_SECONDS": "0.05",
        "RATCHET_AGENT_MODULES": "tests.sample_agents",
        # Workers serve metrics only where a test asks (on a port of its own).
        "RATCHET_WORKER_METRICS_PORT": "0",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _reset_caches()
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    redis.Redis.from_url(REDIS_URL).delete(env["RATCHET_QUEUE_NAME"])
    _reset_caches()


def _reset_caches() -> None:
    from shared.queue import get_celery
    from shared.settings import get_settings
    from shared.store.db import reset_engines

    get_settings.cache_clear()
    get_celery.cache_clear()
    reset_engines()


@dataclass(frozen=True)
class TenantHandle:
    id: str
    name: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture
def make_tenant(service_env: dict[str, str]) -> Iterator[Callable[..., TenantHandle]]:
    """Create tenants (each with one API key); they and their tasks are deleted afterwards."""
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


@pytest.fixture
def tenant(make_tenant: Callable[..., TenantHandle]) -> TenantHandle:
    return make_tenant()
