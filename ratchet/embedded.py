"""``ratchet dev``: the API, a Celery worker (in-memory transport) and SQLite in one process.

The worker runs the same step runner as production; only the queue and the store differ.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
from pathlib import Path

from celery.contrib.testing.worker import start_worker
from sqlalchemy import update
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from api import server
from shared.errors import NotFound
from shared.observability import logs, tracing
from shared.queue import webhook_queue
from shared.settings import Settings, get_settings
from shared.store import backends
from shared.store.db import migrate, transaction
from shared.store.tables import ApiKey
from shared.store.tenants import authenticate, create_key, create_tenant, get_tenant_by_name

DEV_TENANT = "dev"
# The one person running `ratchet dev` is its operator too: fleet views work with this key.
DEV_SCOPES = ("tasks:read", "tasks:write", "tasks:approve", "admin", "operator")


def dev_api_key(session: Session, key_file: Path) -> str:
    """The dev tenant's key: the same on every start, kept in the data directory."""
    if key_file.exists():
        key = key_file.read_text().strip()
        principal = authenticate(session, key)
        if principal is not None:
            if not principal.allows("operator"):  # kept from before the operator scope
                session.execute(
                    update(ApiKey)
                    .where(ApiKey.id == principal.key_id)
                    .values(scopes=sorted(DEV_SCOPES))
                )
            return key
    try:
        tenant = get_tenant_by_name(session, DEV_TENANT)
    except NotFound:
        tenant = create_tenant(session, DEV_TENANT)
    key = create_key(session, tenant, DEV_SCOPES)
    key_file.parent.mkdir(parents=True, exist_ok=True)
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    return key


def key_file(settings: Settings) -> Path:
    """Where the dev key of this database is kept: one file per database, so switching
    ``RATCHET_DATABASE_URL`` back and forth keeps each database's key."""
    if not settings.database_url:
        return settings.data_dir / "dev-api-key"  # the embedded SQLite file
    url = make_url(settings.database_url).render_as_string(hide_password=True)
    return settings.data_dir / f"dev-api-key-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def describe_database(settings: Settings) -> str:
    """The database, for the banner (never its password)."""
    if not settings.database_url:
        return "embedded: SQLite"
    return backends.describe(settings.database_url)


def require_free_port(host: str, port: int) -> None:
    """Stop with one line if the port is taken, before anything is printed or migrated."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as exc:
        sys.stderr.write(f"ratchet dev: cannot listen on {host}:{port}: {exc.strerror or exc}\n")
        raise SystemExit(1) from None


def run(*, host: str, port: int, concurrency: int) -> None:
    require_free_port(host, port)
    os.environ["RATCHET_BROKER_URL"] = "memory://localhost/"
    os.environ.setdefault("RATCHET_SCRIPTED_MODEL", "true")  # the demo model, for trying it
    get_settings.cache_clear()
    settings = get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    migrate()
    with transaction() as session:
        key = dev_api_key(session, key_file(settings))

    from workers import dispatcher, presence, sweeper
    from workers.app import app  # the Celery app with Ratchet's tasks registered

    # Quieter by default than a production process: warnings, unless RATCHET_LOG_LEVEL says.
    level = settings.log_level if "log_level" in settings.model_fields_set else "WARNING"
    logs.configure_from_settings(level)
    tracing.configure("ratchet")
    with start_worker(
        app,
        pool="threads",
        concurrency=concurrency,
        perform_ping_check=False,
        loglevel=level,
        hostname="ratchet-dev@localhost",
        queues=[webhook_queue(settings), settings.queue_name],
    ):
        sweeper.start()  # the in-memory queue does not survive a restart: the sweeper heals
        dispatcher.start()  # admits the backlog (and fires schedules), as on a fleet
        presence.start()  # the fleet view (in this process's memory) lists this worker
        url = f"http://{host}:{port}"
        database = describe_database(settings)
        print(f"Ratchet is running at {url} ({database} + in-process queue)", flush=True)
        print(f"API key for tenant 'dev': {key}", flush=True)
        print(f"Try: export RATCHET_URL={url} RATCHET_KEY={key}", flush=True)
        print(f"Dashboard: {url}/dashboard (log in with the key above)", flush=True)
        sys.stdout.flush()
        server.serve(host=host, port=port, log_level="warning")
