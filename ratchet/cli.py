"""The ``ratchet`` command."""

from __future__ import annotations

import json
import os
import re
import sys
from datetime import UTC, datetime, timedelta
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from ratchet.client import Client
    from shared.store.tables import ApiKey

DEFAULT_URL = "http://127.0.0.1:8000"


class RatchetCLI(typer.Typer):
    """Every failure ends as one line on stderr and exit status 1, never a traceback."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except Exception as exc:
            _err(f"error: {describe(exc)}")
            sys.exit(1)


def describe(exc: BaseException) -> str:
    """One line saying what went wrong, for the errors a command meets in practice."""
    import httpx
    import pydantic
    import redis
    import sqlalchemy.exc

    from ratchet.client import RatchetAPIError

    if isinstance(exc, httpx.TransportError):
        where = exc.request.url.copy_with(path="/", query=None) if _has_request(exc) else "?"
        text = f"cannot reach the Ratchet API at {where} (RATCHET_URL): {exc or type(exc).__name__}"
    elif isinstance(exc, RatchetAPIError):
        text = f"the API answered {exc}"
    elif isinstance(exc, sqlalchemy.exc.DBAPIError):
        text = f"database (RATCHET_DATABASE_URL): {exc.orig or exc}"
    elif isinstance(exc, sqlalchemy.exc.ArgumentError):
        text = f"RATCHET_DATABASE_URL: {exc}"
    elif isinstance(exc, pydantic.ValidationError):
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        text = f"invalid settings: {'; '.join(problems)}"
    elif isinstance(exc, redis.RedisError):
        text = f"Redis (RATCHET_REDIS_URL): {exc}"
    else:
        from shared.errors import RatchetError

        text = str(exc) if isinstance(exc, RatchetError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())  # one line, however the library wrapped its message


def _has_request(exc: Any) -> bool:
    try:
        exc.request  # noqa: B018 - httpx raises RuntimeError when the error has no request
    except RuntimeError:
        return False
    return True


app = RatchetCLI(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Ratchet: durable LLM agent tasks.",
)
tenants = typer.Typer(no_args_is_help=True, help="Manage tenants.")
keys = typer.Typer(no_args_is_help=True, help="Manage API keys.")
tasks = typer.Typer(no_args_is_help=True, help="Read and act on tasks over HTTP.")
webhooks = typer.Typer(no_args_is_help=True, help="Webhook secrets and endpoints.")
app.add_typer(tenants, name="tenants")
app.add_typer(keys, name="keys")
app.add_typer(tasks, name="tasks")
app.add_typer(webhooks, name="webhooks")


def _bench() -> typer.Typer:
    from ratchet.bench import app as bench_app

    return bench_app


app.add_typer(_bench(), name="bench")


def _err(message: str) -> None:
    typer.echo(message, err=True)


def _fail(message: str, code: int = 2) -> typer.Exit:
    _err(f"error: {message}")
    return typer.Exit(code)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"ratchet {metadata.version('ratchet')}")
        raise typer.Exit()


CLIENT_COMMANDS = ("submit", "tail", "tasks")  # talk to a server over HTTP; read no settings


@app.callback()
def main_options(
    ctx: typer.Context,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_show_version, is_eager=True, help="print the version"),
    ] = False,
) -> None:
    """Ratchet: durable LLM agent tasks."""
    # Every command that runs Ratchet reads its settings first: a bad one stops it here, with
    # one line, rather than failing each request or step later.
    if ctx.invoked_subcommand in CLIENT_COMMANDS or "--help" in sys.argv[1:]:
        return
    from ratchet.startup import require_valid_settings

    require_valid_settings()


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
    from api import server
    from shared.observability import logs
    from shared.store.db import require_migrated

    os.environ.setdefault("PGAPPNAME", "ratchet-api")  # its connections, in pg_stat_activity
    require_migrated()
    if workers > 1:
        _share_api_metrics()
    logs.configure_from_settings()
    server.serve(host=host, port=port, workers=workers)


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
    from shared.queue import webhook_queue
    from shared.store.db import require_migrated
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
    try:
        start_http_server(port, registry=registry)
    except OSError as exc:  # e.g. a second worker on this host: it runs, unscraped
        _err(
            f"warning: worker metrics not served on port {port} ({exc.strerror}): give each "
            "worker on a host its own RATCHET_WORKER_METRICS_PORT, or 0"
        )
        return
    _err(f"worker metrics on :{port}/metrics")


@app.command()
def flower(port: int = 5555, address: str = "127.0.0.1") -> None:
    """Run Flower, Celery's monitoring UI, against the broker."""
    from workers.app import app as celery_app

    celery_app.start(["flower", f"--port={port}", f"--address={address}"])


@app.command()
def migrate() -> None:
    """Apply database migrations (safe to run again)."""
    from shared.settings import get_settings
    from shared.store.db import migrate as run_migrations

    run_migrations()
    _err(f"migrated {get_settings().effective_database_url.split('@')[-1]}")


@tenants.command("create")
def tenants_create(
    name: str,
    scope: Annotated[list[str] | None, typer.Option(help="scopes of the first key")] = None,
) -> None:
    """Create a tenant and print its first API key (alone on stdout)."""
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import DEFAULT_SCOPES, create_key, create_tenant

    require_migrated()
    with transaction() as session:
        tenant = create_tenant(session, name)
        key = create_key(session, tenant, tuple(scope or DEFAULT_SCOPES))
    _err(f"created tenant {name!r}")
    typer.echo(key)


@tenants.command("list")
def tenants_list() -> None:
    """Print every tenant as JSON: id, name, created_at."""
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import list_tenants

    require_migrated()
    with transaction() as session:
        rows = [
            {"id": t.id, "name": t.name, "created_at": _iso(t.created_at)}
            for t in list_tenants(session)
        ]
    typer.echo(json.dumps(rows, indent=2))


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()


def _duration(text: str) -> timedelta:
    """``90``, ``90s``, ``15m``, ``12h`` or ``30d``."""
    match = re.fullmatch(r"(\d+)([smhd]?)", text.strip())
    if match is None:
        raise _fail(f"{text!r} is not a duration like 3600, 90s, 15m, 12h or 30d")
    unit = {"": "seconds", "s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
    return timedelta(**{unit[match[2]]: int(match[1])})


def _expiry(expires_in: str | None, expires_at: str | None) -> datetime | None:
    if expires_in and expires_at:
        raise _fail("give --expires-in or --expires-at, not both")
    if expires_in:
        return datetime.now(UTC) + _duration(expires_in)
    if not expires_at:
        return None
    try:
        moment = datetime.fromisoformat(expires_at)
    except ValueError:
        raise _fail(f"--expires-at {expires_at!r} is not an ISO 8601 time") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _key_json(row: ApiKey) -> dict[str, Any]:
    return {
        "id": row.id,
        "prefix": row.prefix,
        "name": row.name,
        "scopes": row.scopes,
        "created_at": _iso(row.created_at),
        "expires_at": _iso(row.expires_at),
        "last_used_at": _iso(row.last_used_at),
        "revoked_at": _iso(row.revoked_at),
    }


@keys.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="tenant name")],
    scope: Annotated[
        list[str] | None,
        typer.Option(help="tasks:read, tasks:write, tasks:approve, admin, operator"),
    ] = None,
    name: Annotated[str | None, typer.Option(help="what the key is for")] = None,
    expires_in: Annotated[
        str | None, typer.Option(help="lifetime: 3600, 90s, 15m, 12h or 30d")
    ] = None,
    expires_at: Annotated[
        str | None, typer.Option(help="expiry as an ISO 8601 time (UTC if no offset)")
    ] = None,
) -> None:
    """Create an API key for a tenant and print it (alone on stdout). It is shown only once.

    Only here can a key get the operator scope (fleet-wide views and actions)."""
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import DEFAULT_SCOPES, create_key, get_tenant_by_name

    expiry = _expiry(expires_in, expires_at)
    require_migrated()
    with transaction() as session:
        key = create_key(
            session,
            get_tenant_by_name(session, tenant),
            tuple(scope or DEFAULT_SCOPES),
            name=name,
            expires_at=expiry,
        )
    typer.echo(key)


@keys.command("list")
def keys_list(tenant: Annotated[str, typer.Option(help="tenant name")]) -> None:
    """Print the tenant's keys as JSON, newest first: prefix, name, scopes, last use."""
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import get_tenant_by_name, list_keys

    require_migrated()
    with transaction() as session:
        tenant_id = get_tenant_by_name(session, tenant).id
        rows = [_key_json(row) for row in list_keys(session, tenant_id, limit=10_000)]
    typer.echo(json.dumps(rows, indent=2))


@keys.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="the key's id (see `keys list`)")],
    tenant: Annotated[str, typer.Option(help="tenant name")],
) -> None:
    """Revoke a key: the next request that carries it is refused."""
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import get_tenant_by_name, revoke_key

    require_migrated()
    with transaction() as session:
        row = revoke_key(session, get_tenant_by_name(session, tenant).id, key_id)
        prefix = row.prefix
    _err(f"revoked key {prefix}…")


@keys.command("rotate")
def keys_rotate(
    key_id: Annotated[str, typer.Argument(help="the key's id (see `keys list`)")],
    tenant: Annotated[str, typer.Option(help="tenant name")],
    grace: Annotated[
        str, typer.Option(help="how long the old key keeps working: 0, 90s, 15m, 12h, 7d")
    ] = "0",
) -> None:
    """Print a new key (alone on stdout) with the old one's name, scopes and lifetime; the old
    key stops working after the grace period (default: at once)."""
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import get_tenant_by_name, rotate_key

    period = _duration(grace)
    require_migrated()
    with transaction() as session:
        _, key = rotate_key(session, get_tenant_by_name(session, tenant).id, key_id, grace=period)
    _err(f"rotated; the old key stops working {'now' if not period else f'in {period}'}")
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

    from shared.settings import get_settings
    from shared.store.db import require_migrated, transaction
    from shared.store.tenants import get_tenant_by_name
    from shared.webhooks import secrets as webhook_secrets

    require_migrated()
    overlap = timedelta(hours=get_settings().webhook_secret_overlap_hours)
    with transaction() as session:
        tenant_id = get_tenant_by_name(session, tenant).id
        if rotate:
            secret = webhook_secrets.rotate(session, tenant_id, overlap=overlap)
        else:
            secret = webhook_secrets.current(session, tenant_id)
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
    from shared.errors import EgressDenied
    from shared.settings import get_settings
    from shared.store import outbox
    from shared.store.db import require_migrated, transaction
    from shared.store.events import EVENT_TYPES, TERMINAL_EVENT_TYPES
    from shared.store.tenants import get_tenant_by_name
    from shared.webhooks.egress import check_url

    require_migrated()
    events = event or list(TERMINAL_EVENT_TYPES)
    unknown = sorted(set(events) - set(EVENT_TYPES))
    if unknown:
        raise _fail(f"unknown event type(s) {', '.join(unknown)}")
    allowed = get_settings().webhook_allowed_hosts
    try:
        check_url(url, allowed_hosts=allowed, https_only=True)
    except EgressDenied as exc:
        # The workers check again when they send; this check can only see this shell's setting.
        raise _fail(
            f"{exc}. This command checks the URL against RATCHET_WEBHOOK_ALLOWED_HOSTS in its "
            f"own environment (here: {','.join(allowed) or 'not set'}): set it here too, to the "
            "value the workers have",
            1,
        ) from None
    with transaction() as session:
        tenant_id = get_tenant_by_name(session, tenant).id
        endpoint = outbox.add_endpoint(session, tenant_id, url=url, events=events)
    typer.echo(endpoint.id)


def _api() -> Client:
    """A client for RATCHET_URL with RATCHET_KEY."""
    from ratchet.client import Client

    key = os.environ.get("RATCHET_KEY")
    if not key:
        raise _fail(f"set RATCHET_KEY to an API key (and RATCHET_URL if not {DEFAULT_URL})")
    return Client(os.environ.get("RATCHET_URL", DEFAULT_URL), key, timeout=75)


def _print(document: Any) -> None:
    typer.echo(json.dumps(document, indent=2))


@app.command()
def tail(task_id: str, after: int = 0) -> None:
    """Print a task's events as they happen (RATCHET_URL, RATCHET_KEY), until it ends."""
    with _api() as client:
        client.get(task_id)  # a wrong id or a server that is down: say so now, not after retries
        for event in client.events(task_id, after=after):
            typer.echo(f"{event.seq:>4} {event.type:<22} {json.dumps(event.data)}")


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
    with _api() as client:
        task = client.submit(body)
        while wait and task["status"] not in TERMINAL:
            task = client.get(task["id"], wait=30)
    _print(task)
    if wait and task["status"] != "succeeded":
        raise typer.Exit(1)


TERMINAL = ("succeeded", "failed", "cancelled")


@tasks.command("get")
def tasks_get(
    task_id: str,
    wait: Annotated[int, typer.Option(help="long-poll up to N s (≤ 60) for a terminal state")] = 0,
) -> None:
    """Print a task as JSON."""
    with _api() as client:
        _print(client.get(task_id, wait=wait or None))


@tasks.command("list")
def tasks_list(
    status: Annotated[str | None, typer.Option(help="only tasks in this state")] = None,
    agent: Annotated[str | None, typer.Option(help="only tasks of this agent")] = None,
    limit: int = 50,
    cursor: Annotated[str | None, typer.Option(help="next_cursor of the previous page")] = None,
) -> None:
    """Print a page of tasks, newest first, as JSON: {"items": [...], "next_cursor": ...}."""
    with _api() as client:
        _print(client.list_tasks(status=status, agent=agent, limit=limit, cursor=cursor))


@tasks.command("cancel")
def tasks_cancel(task_id: str) -> None:
    """Ask for the task to be cancelled (it stops at its next commit point); print it."""
    with _api() as client:
        _print(client.cancel(task_id))


@tasks.command("retry")
def tasks_retry(task_id: str) -> None:
    """Resume a failed task from its last committed step; print it."""
    with _api() as client:
        _print(client.retry(task_id))


def main() -> None:  # pragma: no cover - console entry point
    app(prog_name="ratchet")
    sys.exit(0)
