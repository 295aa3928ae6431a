"""Shared fixtures: the database a test runs on, Redis, tenants on demand.

A test runs on PostgreSQL (with Redis and Celery) unless it is marked
``backends("postgresql", "sqlite")``: then it runs once on each, through the ``backend``
fixture. On PostgreSQL each run migrates a fresh database of its own and uses a Celery queue
name of its own, so runs never see each other's rows or messages. On SQLite each test gets a
fresh migrated database file and the in-process queue and wake-ups of ``ratchet dev``: it
needs neither service.

Without Postgres or Redis the tests that need them (the integration tests on PostgreSQL and
the e2e tests) are skipped locally, and fail the run when CI=true.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psycopg
import pytest
import redis
from sqlalchemy.engine import make_url

from tests.webhook_sends import finish_webhook_sends

ADMIN_URL = os.environ.get(
    "RATCHET_TEST_ADMIN_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
# Each of the suite's parallel runners (pytest-xdist: gw0, gw1, …) has a Redis database of its
# own: the rate limiter's buckets are named by model and tenant, and two tests limiting one
# model at once must not share a bucket. (Its channels are one namespace across databases, but
# every one of them is named by a task or a queue.) Two runs of the suite on one machine at
# once (a file run by hand beside the whole suite) must not share one either: a runner claims
# its database with a key in database 0 naming its process, first the one counting down from
# 15 by its number, else any free one from 15 down to 4 (3 is the benchmarks'; 0 to 2 are left
# to a server run by hand). A claim whose process is gone is taken over.
XDIST_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
REDIS_HOST = "redis://127.0.0.1:6379"


def _claim_redis_database() -> int:
    preferred = 15 - XDIST_WORKER
    mine = f"{socket.gethostname()}:{os.getpid()}"
    try:
        claims = redis.Redis.from_url(f"{REDIS_HOST}/0", socket_timeout=3)
        for number in [preferred, *(n for n in range(15, 3, -1) if n != preferred)]:
            key = f"ratchet-test:database:{number}"
            if claims.set(key, mine, nx=True, ex=6 * 3600):
                atexit.register(_release, claims, key, mine)
                return number
            owner = (claims.get(key) or b"").decode()
            host, _, pid = owner.rpartition(":")
            if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
                claims.delete(key)  # its process is gone; another runner may race for it
                if claims.set(key, mine, nx=True, ex=6 * 3600):
                    atexit.register(_release, claims, key, mine)
                    return number
    except redis.RedisError:
        pass  # Redis is not up: the run says so (MISSING) with the database it would have used
    return preferred


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _release(claims: redis.Redis, key: str, mine: str) -> None:
    try:
        if (claims.get(key) or b"").decode() == mine:
            claims.delete(key)
    except redis.RedisError:
        pass


def _redis_database() -> int:
    """This runner's database: the one its process claimed, or (in a process it started, which
    imports this module again) the one it claimed before."""
    runner = os.environ.get("PYTEST_XDIST_WORKER", "")
    inherited, _, number = os.environ.get(CLAIM, "").rpartition("=")
    if inherited == runner and number.isdigit():
        return int(number)
    claimed = _claim_redis_database()
    os.environ[CLAIM] = f"{runner}={claimed}"
    return claimed


CLAIM = "RATCHET_TEST_REDIS_CLAIM"
REDIS_URL = os.environ.get("RATCHET_TEST_REDIS_URL") or f"{REDIS_HOST}/{_redis_database()}"
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
BACKENDS = ("postgresql", "sqlite")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "backends(*names): the databases a test runs on, one run each (default: postgresql)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("backends")
    if marker is None or "backend" not in metafunc.fixturenames:
        return
    unknown = set(marker.args) - set(BACKENDS)
    if unknown or not marker.args:
        raise pytest.UsageError(f"backends{marker.args}: each must be one of {BACKENDS}")
    if marker.args != ("postgresql",):  # the default needs no parameter (nor a new test id)
        metafunc.parametrize("backend", marker.args, indirect=True)


def backend_of(item: pytest.Item) -> str:
    callspec = getattr(item, "callspec", None)
    return str(callspec.params.get("backend", "postgresql")) if callspec else "postgresql"


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    """Mark what needs PostgreSQL and Redis (the integration tests, but for their SQLite runs,
    and the e2e tests); once -m and -k have deselected theirs, skip those left when a service
    is missing, or fail the run in CI."""
    for item in items:
        path = str(item.path)
        if f"{os.sep}integration{os.sep}" in path and backend_of(item) != "sqlite":
            item.add_marker(pytest.mark.integration)
        if f"{os.sep}e2e{os.sep}" in path:
            item.add_marker(pytest.mark.e2e)
    yield
    if MISSING is None:
        return
    # By marker, not keyword: an item's keywords hold its directories' names too.
    needs_services = [
        i for i in items if i.get_closest_marker("integration") or i.get_closest_marker("e2e")
    ]
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


# What every test environment sets, whatever its database.
COMMON_ENV = {
    "RATCHET_QUEUE_NAME": f"ratchet-test-{RUN_ID}",
    "RATCHET_HTTP_ALLOWED_HOSTS": "127.0.0.1,localhost",
    "RATCHET_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1,localhost",
    "RATCHET_MODEL_RETRY_BASE_SECONDS": "0.05",
    "RATCHET_AGENT_MODULES": "tests.sample_agents",
    # Workers serve metrics only where a test asks (on a port of its own).
    "RATCHET_WORKER_METRICS_PORT": "0",
}


@contextmanager
def environment(env: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """``env`` set in this process (and so in the processes it starts) while the block runs;
    the settings, the Celery app and the engines are made anew on entry and on exit."""
    saved = {k: os.environ.get(k) for k in env}
    finish_webhook_sends()
    os.environ.update(env)
    _reset_caches()
    try:
        yield dict(env)
    finally:
        finish_webhook_sends()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _reset_caches()


@pytest.fixture(scope="session")
def service_env(database_url: str) -> Iterator[dict[str, str]]:
    """The RATCHET_* environment that points this process and its children at the test services."""
    env = {
        **COMMON_ENV,
        "RATCHET_DATABASE_URL": database_url,
        "RATCHET_REDIS_URL": REDIS_URL,
        "RATCHET_BROKER_URL": REDIS_URL,
    }
    with environment(env):
        yield env
    redis.Redis.from_url(REDIS_URL).delete(env["RATCHET_QUEUE_NAME"])


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite database, copied for each test: cheaper than migrating each time."""
    from shared.store.db import migrate

    path = tmp_path_factory.mktemp("sqlite") / "template.db"
    migrate(f"sqlite:///{path}")
    return path


def sqlite_env(path: Path) -> dict[str, str]:
    """The environment of ``ratchet dev`` on the SQLite file ``path``: the in-process queue
    (and with it the in-process wake-ups and rate limiter)."""
    return {
        **COMMON_ENV,
        "RATCHET_DATABASE_URL": f"sqlite:///{path}",
        "RATCHET_BROKER_URL": "memory://localhost/",
        # Nothing may reach for Redis on SQLite: it is pointed at a port nobody listens on.
        "RATCHET_REDIS_URL": "redis://127.0.0.1:1/0",
    }


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """The database this test runs on: PostgreSQL, or in turn each its ``backends`` marker
    names."""
    return str(getattr(request, "param", "postgresql"))


@pytest.fixture
def backend_env(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[dict[str, str]]:
    """The RATCHET_* environment of this test's backend: the run's PostgreSQL and Redis, or a
    fresh SQLite database of the test's own (which needs neither)."""
    if backend == "postgresql":
        yield request.getfixturevalue("service_env")
        return
    path = tmp_path / "ratchet.db"
    shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
    with environment(sqlite_env(path)) as env:
        yield env


class Configure(Protocol):
    """What the ``configure`` fixture gives a test: ``configure(RATCHET_X="1", RATCHET_Y=None)``
    sets ``RATCHET_X`` and unsets ``RATCHET_Y``."""

    def __call__(self, **env: str | None) -> None: ...


@pytest.fixture
def configure(request: pytest.FixtureRequest) -> Iterator[Configure]:
    """Set settings for this test by their environment names
    (``configure(RATCHET_LEASE_TTL_SECONDS="0.9")``; ``None`` unsets one). The settings, and
    the Celery app and engines made from them, are made anew at once. When the test ends the
    variables are put back first and everything is made anew again, so no later test sees them.

    A test on a backend has that backend's environment set first: its end would otherwise
    put its own values back over these."""
    if "backend_env" in request.fixturenames:
        request.getfixturevalue("backend_env")
    with pytest.MonkeyPatch.context() as patch:

        def apply(**env: str | None) -> None:
            for name, value in env.items():
                if value is None:
                    patch.delenv(name, raising=False)
                else:
                    patch.setenv(name, value)
            _reset_caches()

        yield apply
    _reset_caches()


def _reset_caches() -> None:
    from shared.queue import get_celery
    from shared.settings import get_settings
    from shared.store.db import reset_engines
    from shared.transport import reset_transport

    get_settings.cache_clear()
    get_celery.cache_clear()
    reset_engines()
    reset_transport()


@dataclass(frozen=True)
class TenantHandle:
    id: str
    name: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture
def make_tenant(backend_env: dict[str, str]) -> Iterator[Callable[..., TenantHandle]]:
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
