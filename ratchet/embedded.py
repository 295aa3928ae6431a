"""``ratchet dev``: the API, a Celery worker (in-memory transport) and SQLite in one process.

The worker runs the same step runner as production; only the queue and the store differ.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import uvicorn
from celery.contrib.testing.worker import start_worker
from sqlalchemy.orm import Session

from shared import logs, tracing
from shared.db import migrate, transaction
from shared.errors import NotFound
from shared.queue import webhook_queue
from shared.settings import get_settings
from shared.tenants import authenticate, create_key, create_tenant, get_tenant_by_name

DEV_TENANT = "dev"
DEV_SCOPES = ("tasks:read", "tasks:write", "admin")


def dev_api_key(session: Session, key_file: Path) -> str:
    """The dev tenant's key: the same on every start, kept in the data directory."""
    if key_file.exists():
        key = key_file.read_text().strip()
        if authenticate(session, key) is not None:
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


def run(*, host: str, port: int, concurrency: int) -> None:
    os.environ["RATCHET_BROKER_URL"] = "memory://localhost/"
    get_settings.cache_clear()
    settings = get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    migrate()
    with transaction() as session:
        key = dev_api_key(session, settings.data_dir / "dev-api-key")

    from workers import sweeper
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
        url = f"http://{host}:{port}"
        print(f"Ratchet is running at {url} (embedded: SQLite + in-process queue)", flush=True)
        print(f"API key for tenant 'dev': {key}", flush=True)
        print(f"Try: export RATCHET_URL={url} RATCHET_KEY={key}", flush=True)
        sys.stdout.flush()
        uvicorn.run(
            "api.main:create_app",
            factory=True,
            host=host,
            port=port,
            log_level="warning",
            log_config=None,
        )
