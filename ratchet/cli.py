"""The ``ratchet`` command."""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from ratchet import (
    cli_admin,
    cli_batches,
    cli_chat,
    cli_client,
    cli_schedules,
    cli_secrets,
    cli_waits,
    cli_webhooks,
)
from ratchet.console import err


class RatchetCLI(typer.Typer):
    """Every failure ends as one line on stderr and exit status 1, never a traceback."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except Exception as exc:
            err(f"error: {describe(exc)}")
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
app.add_typer(cli_admin.tenants, name="tenants")
app.add_typer(cli_admin.keys, name="keys")
app.add_typer(cli_client.tasks, name="tasks")
app.add_typer(cli_webhooks.webhooks, name="webhooks")
app.add_typer(cli_schedules.schedules, name="schedules")
app.add_typer(cli_batches.batch, name="batch")
app.add_typer(cli_secrets.secrets, name="secrets")


def load_benchmarks() -> typer.Typer:
    """The ``ratchet bench`` commands: the ``benchmarks`` package of the checkout this
    package runs from (a dev install). The wheel and the image hold no benchmarks: there,
    one line says where they come from, and the command exits with status 1."""
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "benchmarks" / "cli.py").is_file() and str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))  # an editable install maps only the product's packages
    try:
        from benchmarks.cli import app as benchmarks_app
    except ModuleNotFoundError as exc:
        err(
            "error: the benchmarks come with a checkout's dev install (pip install -e '.[dev]'),"
            f" not with this one (no module named {exc.name!r})"
        )
        raise typer.Exit(1) from exc
    return benchmarks_app


class BenchmarksGroup(TyperGroup):
    """``ratchet bench``, loaded only when it runs, so the other commands never import it:
    its context is the loaded group's, which parses the rest and runs the benchmark."""

    # Typer's own click contexts (``parent`` and the result), which it does not export.
    def make_context(
        self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any
    ) -> Any:
        group = typer.main.get_command(load_benchmarks())
        return group.make_context(info_name, args, parent=parent, **extra)


app.add_typer(
    typer.Typer(
        cls=BenchmarksGroup, help="Benchmarks (figures are ratios to a same-run baseline)."
    ),
    name="bench",
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"ratchet {metadata.version('ratchet')}")
        raise typer.Exit()


# These talk to a server over HTTP and read no settings.
CLIENT_COMMANDS = (
    "submit",
    "tail",
    "approve",
    "tasks",
    "schedules",
    "batch",
    "children",
    "complete-wait",
)
# These run tasks' code (agents and tools), so they load the agent modules before they start.
SERVING_COMMANDS = ("dev", "api", "worker")


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
    from ratchet.startup import require_agent_modules, require_valid_settings

    require_valid_settings()
    if ctx.invoked_subcommand == "worker":
        _collect_worker_metrics()  # before any module loads prometheus_client
    if ctx.invoked_subcommand in SERVING_COMMANDS:
        require_agent_modules()  # before anything says it is running


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
    from ratchet.startup import warn_if_no_default_model
    from shared.observability import logs
    from shared.store.db import require_migrated

    os.environ.setdefault("PGAPPNAME", "ratchet-api")  # its connections, in pg_stat_activity
    require_migrated()
    warn_if_no_default_model()
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
    "Each process keeps up to --threads steps in flight. A step waiting on its model or a "
    "tool holds one thread and no database connection, so a 2-CPU host with the defaults "
    "keeps up to 768 model calls in flight; between its waits a step runs in turn, at most "
    "RATCHET_DB_POOL_SIZE of a process's at once.\n\n"
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
            help="steps each process keeps in flight (default: RATCHET_WORKER_THREADS, 384)",
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


def _collect_worker_metrics() -> None:
    """Give this worker and its prefork children a fresh directory for their metrics (each
    process writes its own files there). prometheus_client reads it once, when it loads, and
    the store, the agents' modules and the Python client all load it: so this runs first."""
    import tempfile

    from shared.settings import get_settings

    if get_settings().worker_metrics_port:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="ratchet-metrics-")


def _serve_worker_metrics(port: int) -> None:
    """Serve the metrics of this worker and its prefork children (multiprocess mode: each
    process writes its own files, this server adds them up)."""
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    directory = os.environ["PROMETHEUS_MULTIPROC_DIR"]  # made by _collect_worker_metrics

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    try:
        start_http_server(port, registry=registry)
    except OSError as exc:  # e.g. a second worker on this host: it runs, unscraped
        err(
            f"warning: worker metrics not served on port {port} ({exc.strerror}): give each "
            "worker on a host its own RATCHET_WORKER_METRICS_PORT, or 0"
        )
        return
    err(f"worker metrics on :{port}/metrics")


@app.command()
def flower(port: int = 5555, address: str = "127.0.0.1") -> None:
    """Run Flower, Celery's monitoring UI, against the broker."""
    from workers.app import app as celery_app

    celery_app.start(["flower", f"--port={port}", f"--address={address}"])


@app.command()
def migrate() -> None:
    """Create the database if its server has none of that name, then apply the migrations
    (safe to run again)."""
    from shared.settings import get_settings
    from shared.store.db import create_missing_database
    from shared.store.db import migrate as run_migrations

    url = get_settings().effective_database_url
    if create_missing_database(url):
        err(f"created database {url.split('@')[-1]}")
    run_migrations()
    err(f"migrated {url.split('@')[-1]}")


app.command()(cli_client.tail)
app.command()(cli_client.submit)
app.command()(cli_client.approve)
app.command()(cli_chat.chat)
app.command()(cli_waits.children)
app.command("complete-wait")(cli_waits.complete_wait)


def main() -> None:  # pragma: no cover - console entry point
    app(prog_name="ratchet")
    sys.exit(0)
