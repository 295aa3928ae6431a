"""The ``ratchet`` command."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Ratchet: durable LLM agent tasks."
)
tenants = typer.Typer(no_args_is_help=True, help="Manage tenants.")
keys = typer.Typer(no_args_is_help=True, help="Manage API keys.")
webhooks = typer.Typer(no_args_is_help=True, help="Webhook secrets and endpoints.")
app.add_typer(tenants, name="tenants")
app.add_typer(keys, name="keys")
app.add_typer(webhooks, name="webhooks")


def _bench() -> typer.Typer:
    from ratchet.bench import app as bench_app

    return bench_app


app.add_typer(_bench(), name="bench")


def _err(message: str) -> None:
    typer.echo(message, err=True)


@app.command()
def dev(
    host: str = "127.0.0.1",
    port: int = 8000,
    concurrency: Annotated[
        int, typer.Option(help="Celery threads taking messages (steps run on the step pool)")
    ] = 4,
) -> None:
    """Run everything in one process: SQLite, an in-process queue, the API and a worker."""
    from ratchet import embedded

    embedded.run(host=host, port=port, concurrency=concurrency)


@app.command()
def api(host: str = "127.0.0.1", port: int = 8000, workers: int = 1) -> None:
    """Serve the HTTP API with uvicorn (production: Postgres + Redis)."""
    import uvicorn

    from shared import logs
    from shared.db import require_migrated

    os.environ.setdefault("PGAPPNAME", "ratchet-api")  # its connections, in pg_stat_activity
    require_migrated()
    if workers > 1:
        _share_api_metrics()
    logs.configure_from_settings()
    uvicorn.run(
        "api.main:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_config=None,  # uvicorn's records go through Ratchet's handler (RATCHET_LOG_FORMAT)
    )


def _share_api_metrics() -> None:
    """Several API processes answer /metrics with the sum of all of them (prometheus_client's
    multiprocess mode: each process writes its own files, the one scraped adds them up), so
    a scrape never shows one process's share. The processes inherit the directory."""
    import tempfile

    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or tempfile.mkdtemp(
        prefix="ratchet-api-metrics-"
    )
    Path(directory).mkdir(parents=True, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory


WORKER_HELP = (
    "Run a Celery worker that advances tasks, a step at a time.\n\n"
    "Each process runs up to --threads steps at once. A step waiting on its model or a tool "
    "holds one thread and no database connection, so a 2-CPU host with the defaults keeps "
    "about 500 model calls in flight.\n\n"
    "A host holds at most --concurrency × (RATCHET_DB_POOL_SIZE + RATCHET_DB_POOL_OVERFLOW + 1) "
    "+ 2 PostgreSQL connections: 18 on a 2-CPU host with the defaults."
)


@app.command(help=WORKER_HELP)
def worker(
    concurrency: Annotated[
        int, typer.Option(help="worker processes (default: one per CPU)", show_default=False)
    ] = 0,
    threads: Annotated[
        int,
        typer.Option(
            help="steps each process runs at once (default: RATCHET_WORKER_THREADS, 256)",
            show_default=False,
        ),
    ] = 0,
    pool: str = "prefork",
    loglevel: Annotated[str | None, typer.Option(help="default: RATCHET_LOG_LEVEL")] = None,
    hostname: str | None = None,
) -> None:
    # SIGTERM (what deploys send) becomes Celery's soft shutdown: running steps get
    # RATCHET_SHUTDOWN_GRACE_SECONDS, then their messages go back on the queue. Celery reads
    # this when its worker module loads, so it is set before anything imports it.
    os.environ.setdefault("REMAP_SIGTERM", "SIGQUIT")
    os.environ.setdefault("PGAPPNAME", "ratchet-worker")  # its connections, in pg_stat_activity
    if threads:
        os.environ["RATCHET_WORKER_THREADS"] = str(threads)  # read by every pool process
    from shared.settings import get_settings

    get_settings.cache_clear()
    settings = get_settings()
    if settings.worker_metrics_port:
        _serve_worker_metrics(settings.worker_metrics_port)
    from shared.db import require_migrated
    from shared.queue import webhook_queue
    from workers.app import app as celery_app

    require_migrated()
    queues = f"{webhook_queue(settings)},{settings.queue_name}"
    level = loglevel or settings.log_level
    processes = concurrency or os.cpu_count() or 1
    argv = ["worker", f"--concurrency={processes}", f"--pool={pool}", f"--loglevel={level}"]
    argv.append(f"--queues={queues}")
    argv += ["--without-gossip", "--without-mingle"]
    if hostname:
        argv.append(f"--hostname={hostname}")
    celery_app.worker_main(argv)


def _serve_worker_metrics(port: int) -> None:
    """Serve the metrics of this worker and its prefork children (multiprocess mode: each
    process writes its own files, this server adds them up)."""
    import tempfile

    directory = tempfile.mkdtemp(prefix="ratchet-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # before prometheus_client loads
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    start_http_server(port, registry=registry)
    _err(f"worker metrics on :{port}/metrics")


@app.command()
def flower(port: int = 5555, address: str = "127.0.0.1") -> None:
    """Run Flower, Celery's monitoring UI, against the broker."""
    from workers.app import app as celery_app

    celery_app.start(["flower", f"--port={port}", f"--address={address}"])


@app.command()
def migrate() -> None:
    """Apply database migrations (safe to run again)."""
    from shared.db import migrate as run_migrations
    from shared.settings import get_settings

    run_migrations()
    _err(f"migrated {get_settings().effective_database_url.split('@')[-1]}")


@tenants.command("create")
def tenants_create(
    name: str,
    scope: Annotated[list[str] | None, typer.Option(help="scopes of the first key")] = None,
) -> None:
    """Create a tenant and print its first API key (alone on stdout)."""
    from shared.db import require_migrated, transaction
    from shared.errors import RatchetError
    from shared.tenants import DEFAULT_SCOPES, create_key, create_tenant

    require_migrated()
    try:
        with transaction() as session:
            tenant = create_tenant(session, name)
            key = create_key(session, tenant, tuple(scope or DEFAULT_SCOPES))
    except RatchetError as exc:
        _err(f"error: {exc}")
        raise typer.Exit(1) from None
    _err(f"created tenant {name!r}")
    typer.echo(key)


@keys.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="tenant name")],
    scope: Annotated[list[str] | None, typer.Option(help="tasks:read, tasks:write, admin")] = None,
) -> None:
    """Create an API key for a tenant and print it (alone on stdout). It is shown only once."""
    from shared.db import require_migrated, transaction
    from shared.errors import RatchetError
    from shared.tenants import DEFAULT_SCOPES, create_key, get_tenant_by_name

    require_migrated()
    try:
        with transaction() as session:
            key = create_key(
                session, get_tenant_by_name(session, tenant), tuple(scope or DEFAULT_SCOPES)
            )
    except RatchetError as exc:
        _err(f"error: {exc}")
        raise typer.Exit(1) from None
    typer.echo(key)


@webhooks.command("secret")
def webhooks_secret(
    tenant: Annotated[str, typer.Option(help="tenant name")],
    rotate: Annotated[
        bool, typer.Option(help="make a new secret; the old one keeps signing for the overlap")
    ] = False,
) -> None:
    """Print the tenant's current webhook signing secret (alone on stdout)."""
    from datetime import timedelta

    from shared import webhook_secrets
    from shared.db import require_migrated, transaction
    from shared.errors import RatchetError
    from shared.settings import get_settings
    from shared.tenants import get_tenant_by_name

    require_migrated()
    overlap = timedelta(hours=get_settings().webhook_secret_overlap_hours)
    try:
        with transaction() as session:
            tenant_id = get_tenant_by_name(session, tenant).id
            if rotate:
                secret = webhook_secrets.rotate(session, tenant_id, overlap=overlap)
            else:
                secret = webhook_secrets.current(session, tenant_id)
    except RatchetError as exc:
        _err(f"error: {exc}")
        raise typer.Exit(1) from None
    if rotate:
        _err(f"rotated; the previous secret keeps signing for {overlap}")
    typer.echo(secret)


@webhooks.command("add-endpoint")
def webhooks_add_endpoint(
    tenant: Annotated[str, typer.Option(help="tenant name")],
    url: Annotated[str, typer.Option(help="the receiver's URL (https)")],
    event: Annotated[
        list[str] | None, typer.Option(help="event types (default: terminal ones)")
    ] = None,
) -> None:
    """Add a default endpoint: it receives these events of every task of the tenant."""
    from shared import outbox
    from shared.db import require_migrated, transaction
    from shared.egress import check_url
    from shared.errors import RatchetError
    from shared.events import EVENT_TYPES, TERMINAL_EVENT_TYPES
    from shared.settings import get_settings
    from shared.tenants import get_tenant_by_name

    require_migrated()
    events = event or list(TERMINAL_EVENT_TYPES)
    unknown = sorted(set(events) - set(EVENT_TYPES))
    if unknown:
        _err(f"error: unknown event type(s) {', '.join(unknown)}")
        raise typer.Exit(2)
    try:
        check_url(url, allowed_hosts=get_settings().webhook_allowed_hosts, https_only=True)
        with transaction() as session:
            tenant_id = get_tenant_by_name(session, tenant).id
            endpoint = outbox.add_endpoint(session, tenant_id, url=url, events=events)
    except RatchetError as exc:
        _err(f"error: {exc}")
        raise typer.Exit(1) from None
    typer.echo(endpoint.id)


@app.command()
def tail(task_id: str, after: int = 0) -> None:
    """Print a task's events as they happen (RATCHET_URL, RATCHET_KEY), until it ends."""
    from ratchet.client import Client

    url = os.environ.get("RATCHET_URL", "http://127.0.0.1:8000")
    key = os.environ.get("RATCHET_KEY")
    if not key:
        _err("set RATCHET_KEY to an API key (and RATCHET_URL if not http://127.0.0.1:8000)")
        raise typer.Exit(2)
    with Client(url, key) as client:
        for event in client.events(task_id, after=after):
            typer.echo(f"{event.seq:>4} {event.type:<22} {json.dumps(event.data)}")


def _client() -> httpx.Client:
    url = os.environ.get("RATCHET_URL", "http://127.0.0.1:8000")
    key = os.environ.get("RATCHET_KEY")
    if not key:
        _err("set RATCHET_KEY to an API key (and RATCHET_URL if not http://127.0.0.1:8000)")
        raise typer.Exit(2)
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=75)


@app.command()
def submit(
    input: Annotated[str, typer.Option("--input", "-i", help="the task's input text")],
    agent: str = "default",
    model: str | None = None,
    script: Annotated[
        Path | None, typer.Option(help="JSON file: the scripted model's turns")
    ] = None,
    tool: Annotated[list[str] | None, typer.Option(help="restrict to these tools")] = None,
    max_steps: int | None = None,
    wait: Annotated[bool, typer.Option(help="wait for the task to finish")] = False,
) -> None:
    """Submit a task over HTTP (RATCHET_URL, RATCHET_KEY) and print it as JSON."""
    body: dict[str, Any] = {"agent": agent, "input": input}
    if model:
        body["model"] = model
    if script:
        turns = json.loads(script.read_text())
        body["model_options"] = {"script": turns["script"] if isinstance(turns, dict) else turns}
    if tool:
        body["tools"] = tool
    if max_steps:
        body["max_steps"] = max_steps
    with _client() as client:
        response = client.post("/v1/tasks", json=body)
        if response.status_code >= 400:
            _err(response.text)
            raise typer.Exit(1)
        task = response.json()
        while wait and task["status"] not in ("succeeded", "failed", "cancelled"):
            task = client.get(f"/v1/tasks/{task['id']}", params={"wait": 30}).json()
            time.sleep(0 if task["status"] in ("succeeded", "failed", "cancelled") else 0.1)
    typer.echo(json.dumps(task, indent=2))
    if wait and task["status"] != "succeeded":
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover - console entry point
    app(prog_name="ratchet")
    sys.exit(0)
