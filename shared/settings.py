"""The one settings object, read from ``RATCHET_*`` environment variables or ``.env``."""

from __future__ import annotations

import threading
from ipaddress import ip_network
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from shared.errors import InvalidRequest

CommaList = Annotated[list[str], NoDecode]
REDIS_SCHEMES = ("redis", "rediss", "unix")


def _split_commas(value: object) -> object:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


class Settings(BaseSettings):
    """Every knob an operator can turn. Read through :func:`get_settings`, never at import time."""

    model_config = SettingsConfigDict(env_prefix="RATCHET_", env_file=".env", extra="ignore")

    data_dir: Path = Path(".ratchet")
    database_url: str = ""
    redis_url: str = "redis://127.0.0.1:6379/0"
    broker_url: str = ""
    queue_name: str = "ratchet"
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    tracing: Literal["off", "console", "otlp"] = "off"

    default_model: str = "scripted"
    default_max_steps: int = Field(20, ge=1)
    max_steps_limit: int = Field(200, ge=1)
    max_request_bytes: int = Field(1_000_000, ge=1024)
    task_deadline_seconds: float = Field(3600.0, ge=0)  # 0: no deadline
    agent_modules: CommaList = []
    # Live API keys (neither revoked nor expired) a tenant may hold through the API; past it,
    # creating one is a 409. A rotation replaces a key and is not counted; the CLI is not bound.
    max_keys_per_tenant: int = Field(100, ge=1, le=100_000)

    lease_ttl_seconds: float = Field(30.0, gt=0)
    max_step_attempts: int = Field(5, ge=1)
    visibility_timeout_seconds: int = Field(3600, ge=60)
    step_time_limit_seconds: int = Field(900, ge=10)
    shutdown_grace_seconds: float = Field(20.0, ge=0)
    worker_metrics_port: int = Field(9464, ge=0, le=65535)  # 0: no metrics server
    # Steps one worker process keeps in flight: a step waiting on its model or a tool holds
    # one of these threads and nothing scarcer (no database connection, no Celery slot, no
    # turn: only db_pool_size steps of a process run their own code at once).
    worker_threads: int = Field(384, ge=1, le=4096)
    # Calls a step stopped waiting for (past their deadline) that may still run in one worker
    # process before it stops taking work, lets its leases go and is replaced by a fresh one.
    worker_max_abandoned_calls: int = Field(32, ge=1, le=4096)
    # Database connections per process (the pool, and how far past it a burst may go); the
    # lease heartbeat has one more of its own.
    db_pool_size: int = Field(6, ge=1, le=100)
    db_pool_overflow: int = Field(1, ge=0, le=100)
    # How long PostgreSQL may keep a caller waiting before it gets an error (a 503 from the
    # API): to connect, for a free connection in the pool, for one statement (also the bound
    # on waiting for a server that went silent mid-statement; 0: no bound), and between the
    # statements of an open transaction (empty: the lease's length, so a stalled process
    # never keeps the rows it locked). Keepalives find a dead peer of an idle connection.
    db_connect_timeout_seconds: int = Field(5, ge=2, le=300)
    db_pool_timeout_seconds: float = Field(10.0, gt=0)
    db_statement_timeout_seconds: float = Field(30.0, ge=0)
    db_idle_in_transaction_timeout_seconds: float | None = Field(None, gt=0)
    db_keepalive_seconds: int = Field(10, ge=1, le=3600)
    sweep_interval_seconds: float = Field(5.0, gt=0)
    sweep_grace_seconds: float = Field(30.0, ge=0)
    # Each process that runs steps publishes its presence this often; a process that stops
    # publishing drops out of the fleet's live view after three of these.
    presence_interval_seconds: float = Field(5.0, gt=0)
    # Flower, for the fleet view to link to (e.g. https://flower.example.com); none if unset.
    flower_url: str | None = None

    # How long a tool call may wait for a person's decision (unless its tool or the task
    # says otherwise), and what happens then: reject the call, approve it, or fail the task.
    approval_timeout_seconds: float = Field(86_400.0, gt=0, le=30 * 86_400)
    approval_on_timeout: Literal["reject", "approve", "fail"] = "reject"
    # Approval links: with both set, each waiting call gets a signed, single-use link (in
    # ``pending_approval`` and the ``task.awaiting_approval`` event) that decides it without
    # an API key. It is shown only to a key that may decide (``tasks:approve``), and in
    # webhook bodies only when webhook_approval_links is on: whoever receives them can decide.
    approval_link_secret: SecretStr | None = None
    public_url: str | None = None
    webhook_approval_links: bool = False

    model_timeout_seconds: float = Field(60.0, gt=0)
    # The most one attempt of a model call may take in all (the timeout above bounds each
    # read); empty: twice model_timeout_seconds. Past it the attempt fails as a timeout.
    model_call_deadline_seconds: float | None = Field(None, gt=0)
    model_max_attempts: int = Field(5, ge=1)
    model_retry_base_seconds: float = Field(0.5, ge=0)
    model_retry_inline_max_seconds: float = Field(5.0, ge=0)
    openai_base_url: str | None = None
    openai_api_key: SecretStr | None = None
    anthropic_base_url: str | None = None
    anthropic_api_key: SecretStr | None = None
    # Anthropic prompt caching: cache_control on the stable prefix (the system prompt and the
    # tool definitions) of every call; a task turns it off with model_options.prompt_caching.
    anthropic_prompt_caching: bool = True
    # Prices (shared/prices.json ships with the package): a JSON file of the same form whose
    # models replace or add to the shipped ones.
    prices_file: Path | None = None
    # The deterministic `scripted` model: on under `ratchet dev` and in the tests, off in
    # production, where a task could otherwise hold a worker for as long as it likes.
    scripted_model: bool = False
    scripted_max_delay_ms: int = Field(60_000, ge=0, le=600_000)
    # Live token streaming: whether a task's model calls stream when neither the task nor its
    # agent says (``stream``); its deltas reach the task's event streams (shared/deltas.py).
    stream_default: bool = True
    # Structured output: how often an answer that misses the task's output_schema goes back to
    # the model before the task fails (invalid_output), and the largest schema accepted.
    output_retries: int = Field(2, ge=0, le=20)
    output_schema_max_bytes: int = Field(65_536, ge=1024, le=1_048_576)
    # Multimodal input: the largest image or file part (decoded), and all of a task's parts.
    input_part_max_bytes: int = Field(5_000_000, ge=1024)
    input_max_bytes: int = Field(20_000_000, ge=1024)

    rate_limits: str = ""
    rate_limits_file: Path | None = None
    # Scheduling (shared.scheduling): concurrency limits per tenant, agent and pool, and
    # queue caps, as JSON or a TOML file (an operator's runtime settings override both).
    concurrency: str = ""
    concurrency_file: Path | None = None
    # Admission: round-robin across tenants (off: one FIFO for everyone, by priority and due
    # time); at most this many admitted messages wait in the broker ahead of the workers;
    # the fleet's slots (empty: the live workers' threads); how often the dispatcher looks
    # again while a backlog waits; how late a schedule's tick may fire before it is missed.
    # Direct admission: a submission that nothing waits ahead of skips the backlog (off: some
    # 7 ms later to start on an idle fleet, but the API sends no message and a round sends
    # many at once).
    fair_scheduling: bool = True
    direct_admission: bool = True
    dispatch_window: int = Field(256, ge=1, le=100_000)
    dispatch_capacity: int | None = Field(None, ge=1)
    dispatch_interval_seconds: float = Field(0.1, gt=0, le=10)
    # A tenant with no max_running of its own (nor a "*" one) holds at most this share of
    # the fleet's slots at once, so one tenant's flood of slow tasks never holds them all
    # (1: no default share). Applies with fair scheduling on.
    tenant_default_share: float = Field(0.5, gt=0, le=1)
    schedule_misfire_grace_seconds: float = Field(60.0, ge=0)
    # Schedules: how many a tenant may have, how large a schedule's task body may be (as
    # JSON), and how often at most a cron may fire (0: as often as it likes).
    max_schedules_per_tenant: int = Field(100, ge=1, le=1_000_000)
    schedule_max_task_bytes: int = Field(65_536, ge=1024)
    schedule_min_interval_seconds: int = Field(60, ge=0, le=86_400)
    rate_limit_inline_wait_ms: int = Field(250, ge=0)
    # AIMD: each provider 429 halves the model's configured rates (not below a tenth), and
    # they creep back by a tenth of the configured rate per minute without one.
    rate_limit_adaptive: bool = False
    # Load the tiktoken encoding an OpenAI model counts with (o200k_base for gpt-4o and
    # later) in the background, from tiktoken's cache or downloaded into it; off, the
    # installed cl100k_base counts for every OpenAI model (never touching the network).
    tokenizer_downloads: bool = False
    provider_block_default_seconds: float = Field(1.0, ge=0)

    http_allowed_hosts: CommaList = []
    webhook_allowed_hosts: CommaList = []
    # Seconds before each attempt: the first is immediate, then 5 s, 5 min, 30 min, 2 h, …
    webhook_retry_schedule: Annotated[list[Annotated[float, Field(ge=0)]], NoDecode] = [
        0,
        5,
        300,
        1800,
        7200,
        18000,
        36000,
        36000,
    ]
    webhook_timeout_seconds: float = Field(10.0, gt=0)
    webhook_secret_overlap_hours: float = Field(24.0, ge=0)
    # Webhook sending, fair between tenants and receivers (workers/webhook_sender.py): each
    # worker process sends on webhook_sender_threads threads, taken by the tenants in turn; a
    # tenant holds at most webhook_tenant_concurrency of them, and one receiver (a tenant's
    # scheme://host:port) at most webhook_destination_concurrency, so a tenant's hanging
    # receivers never hold every thread.
    webhook_sender_threads: int = Field(16, ge=1, le=1024)
    webhook_tenant_concurrency: int = Field(4, ge=1)
    webhook_destination_concurrency: int = Field(2, ge=1)
    # An endpoint's circuit opens after this many failed attempts in a row: its deliveries
    # wait (per the retry schedule) without a request, and after the cooldown (doubling while
    # it keeps failing, up to 64 times) one probe goes out; a success closes it again.
    webhook_breaker_failures: int = Field(5, ge=1)
    webhook_breaker_cooldown_seconds: float = Field(60.0, gt=0)
    max_webhook_endpoints_per_tenant: int = Field(100, ge=1, le=100_000)
    tool_timeout_seconds: float = Field(60.0, gt=0)
    # Where tool calls run unless their tool says: in a thread of the worker, or in a
    # killable tool process.
    tool_isolation: Literal["thread", "process"] = "thread"
    # Tenant secrets (shared/vault.py): one or more Fernet keys, comma-separated; the first
    # encrypts, every one decrypts (rotation: a new key first, `ratchet secrets reencrypt`,
    # then drop the old). Unset: no tenant secrets can be set or handed to tools.
    secrets_key: SecretStr | None = None
    # Tool processes (workers/tool_processes): how many one worker process keeps; how many
    # calls one serves, and how large it may grow (resident MiB, checked after each call),
    # before it is replaced; the most address space (MiB) and CPU seconds one call may use;
    # how many processes a call may start besides its tool process; and how long a new tool
    # process may take to import the agent modules and say it is ready.
    tool_process_pool_size: int = Field(4, ge=1, le=256)
    tool_process_max_calls: int = Field(10_000, ge=1)
    tool_process_recycle_rss_mb: int = Field(512, ge=16)
    tool_process_memory_limit_mb: int = Field(1024, ge=128)
    tool_process_cpu_seconds: int = Field(60, ge=1)
    tool_process_max_processes: int = Field(32, ge=0, le=10_000)
    tool_process_start_timeout_seconds: float = Field(30.0, gt=0)
    # How many of one step's tool calls run at once (the model asked for several in one
    # answer); each outcome commits as it finishes.
    tool_concurrency: int = Field(8, ge=1, le=64)
    # Sub-agents: how deep a tree of tasks may grow below its root (a child of a root is at
    # depth 1); a call past it is a tool error the model reads.
    subagent_max_depth: int = Field(3, ge=1, le=32)
    # Durable waits: how long a wait may last unless its tool says (at most 30 days), and
    # what happens then: fail the call, tell the model it timed out, or fail the task.
    wait_timeout_seconds: float = Field(86_400.0, gt=0, le=30 * 86_400)
    wait_on_timeout: Literal["fail_call", "tell_model", "fail_task"] = "fail_call"
    # Batches: the most tasks one POST /v1/tasks/batch may submit.
    batch_max_tasks: int = Field(1000, ge=1, le=10_000)
    # MCP servers as tools (shared/mcp): JSON by server name, in the setting or a file (the
    # setting wins for a name in both), and how long a process trusts a server's tool list
    # before it lists again (a notifications/tools/list_changed refreshes it sooner).
    mcp_servers: str = ""
    mcp_servers_file: Path | None = None
    mcp_tools_ttl_seconds: float = Field(300.0, gt=0, le=86_400)
    # Tool results: the most characters of one that the model reads (the rest is cut out of
    # the prompt with a marker saying how much; the ledger keeps it whole). A tool's own
    # max_result_chars wins over it.
    tool_result_max_chars: int = Field(50_000, ge=200, le=100_000_000)
    # The run_python tool's sandbox (shared/sandbox): bubblewrap's namespaces, an explicitly
    # weaker plain subprocess an operator opts into, or off. Each task's workspace lives in
    # sandbox_dir (empty: <data_dir>/sandbox). One run's limits: wall time, CPU seconds,
    # address space, processes, bytes read of stdout and of stderr, and the size of one file.
    # A worker running as root starts the sandbox as sandbox_uid, so the kernel's limit on
    # processes applies (it never does to root).
    sandbox: Literal["bubblewrap", "unsafe-subprocess", "off"] = "bubblewrap"
    sandbox_bwrap: str = "bwrap"
    sandbox_dir: Path | None = None
    sandbox_timeout_seconds: float = Field(30.0, gt=0, le=3600)
    sandbox_cpu_seconds: int = Field(30, ge=1, le=3600)
    sandbox_memory_mb: int = Field(512, ge=64, le=65_536)
    sandbox_max_processes: int = Field(16, ge=2, le=4096)
    sandbox_max_output_bytes: int = Field(100_000, ge=1024, le=100_000_000)
    sandbox_max_file_mb: int = Field(64, ge=1, le=65_536)
    sandbox_uid: int = Field(65534, ge=1, le=4_294_967_294)

    # The context window (shared/context_window.py): each model's window in tokens, as JSON
    # ({"openai:my-model": 32768}) over the table of known models; the window of a model in
    # neither; the policy that keeps a task's prompt inside it when neither the task nor its
    # agent names one; the room kept for the answer when the task sets no max_tokens (at most
    # a quarter of the window); and the most a summary of the summarize policy may write.
    model_context_windows: dict[str, int] = {}
    default_context_window: int = Field(32_768, ge=1024, le=100_000_000)
    context_policy: Literal["truncate", "summarize", "off"] = "truncate"
    context_reserve_tokens: int = Field(4096, ge=16, le=1_000_000)
    summary_max_tokens: int = Field(1024, ge=64, le=100_000)

    # The API server under hostile clients (api/server.py) and its waiting requests
    # (api/stream_limits.py). A request head (request line and headers) over these sizes is
    # refused with a 431; one not complete within the header timeout, or a body not complete
    # within the body timeout, is dropped. Requests in progress past api_max_connections get
    # a 503 (a connection still sending its head, or idle between requests, is not counted);
    # a client address holds at most api_max_connections_per_client connections, unless it
    # is a trusted proxy (whose X-Forwarded-For is then believed).
    api_max_header_bytes: int = Field(65_536, ge=1024, le=16_777_216)
    api_max_headers: int = Field(100, ge=10, le=10_000)
    api_header_timeout_seconds: float = Field(10.0, gt=0)
    api_body_timeout_seconds: float = Field(30.0, gt=0)
    api_keep_alive_seconds: int = Field(5, ge=1)
    api_max_connections: int = Field(2048, ge=16)
    api_backlog: int = Field(2048, ge=16)
    api_max_connections_per_client: int = Field(256, ge=1)
    api_trusted_proxies: CommaList = ["127.0.0.1", "::1"]
    # On SIGTERM open SSE streams end at once; other requests get this long to finish.
    api_shutdown_grace_seconds: float = Field(10.0, ge=0)
    # A bearer token Prometheus may scrape the API's /metrics with (else an operator key).
    metrics_token: SecretStr | None = None
    # SSE streams and long polls (?wait=) held open at once by one API process: in all, and
    # by one tenant. Past them a request gets a 503 or a 429, with Retry-After.
    api_max_streams: int = Field(1000, ge=1)
    api_max_streams_per_tenant: int = Field(100, ge=1)

    _split = field_validator(
        "agent_modules",
        "http_allowed_hosts",
        "webhook_allowed_hosts",
        "webhook_retry_schedule",
        "api_trusted_proxies",
        mode="before",
    )(_split_commas)

    # --- checked when the settings are read, so a bad value stops a process at start -------

    @field_validator("api_trusted_proxies")
    @classmethod
    def _proxies(cls, value: list[str]) -> list[str]:
        for item in value:
            if item != "*":
                try:
                    ip_network(item, strict=False)
                except ValueError:
                    raise ValueError(f"not an IP address, a network or *: {item!r}") from None
        return value

    @field_validator("metrics_token")
    @classmethod
    def _metrics_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        if len(value.get_secret_value()) < 32:
            raise ValueError("at least 32 characters (e.g. `openssl rand -hex 32`)")
        return value

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        if not value:
            return value
        # Accept the usual libpq-style URL and point SQLAlchemy at psycopg 3.
        for prefix in ("postgres://", "postgresql://"):
            if value.startswith(prefix):
                value = "postgresql+psycopg://" + value[len(prefix) :]
        try:
            backend = make_url(value).get_backend_name()
        except (ArgumentError, ValueError):  # ValueError: a port that is not a number
            raise ValueError("not a database URL (postgresql://… or sqlite:///…)") from None
        if backend not in ("postgresql", "sqlite"):
            raise ValueError(f"{backend!r} is not supported: use postgresql://… or sqlite:///…")
        return value

    @field_validator("redis_url", "broker_url")
    @classmethod
    def _broker_url(cls, value: str, info: ValidationInfo) -> str:
        if not value:
            return value
        parts = urlsplit(value)
        schemes = REDIS_SCHEMES if info.field_name == "redis_url" else None
        if not parts.scheme or "://" not in value or (schemes and parts.scheme not in schemes):
            raise ValueError(f"not a URL of {' or '.join(schemes or ('a broker',))}: {value!r}")
        return value

    @field_validator("approval_link_secret")
    @classmethod
    def _link_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        if len(value.get_secret_value()) < 32:
            raise ValueError("at least 32 characters (e.g. `openssl rand -hex 32`)")
        return value

    @field_validator("secrets_key")
    @classmethod
    def _secrets_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value().strip():
            return None
        from shared.vault import parse_keys  # imported late: it reads these settings

        parse_keys(value.get_secret_value())
        return value

    @field_validator("openai_base_url", "anthropic_base_url", "flower_url", "public_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if not value:
            return None  # set but empty: the provider's own endpoint
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL with a host: {value!r}")
        return value

    @field_validator("openai_api_key", "anthropic_api_key")
    @classmethod
    def _key(cls, value: SecretStr | None) -> SecretStr | None:
        return value if value is not None and value.get_secret_value() else None

    @field_validator("default_model")
    @classmethod
    def _model(cls, value: str) -> str:
        from shared.model_strings import parse_model  # imported late: it reads these settings

        try:
            parse_model(value)
        except InvalidRequest as exc:
            raise ValueError(exc.reason) from None
        return value

    @field_validator("model_context_windows")
    @classmethod
    def _context_windows(cls, value: dict[str, int]) -> dict[str, int]:
        from shared.model_strings import parse_model  # imported late: it reads these settings

        for model, tokens in value.items():
            try:
                parse_model(model)
            except InvalidRequest as exc:
                raise ValueError(f"{model!r}: {exc.reason}") from None
            if tokens < 1024:
                raise ValueError(f"{model!r}: a window of at least 1024 tokens, not {tokens}")
        return value

    @field_validator("rate_limits")
    @classmethod
    def _rate_limits(cls, value: str) -> str:
        if value.strip():
            from shared.ratelimit.rules import (
                parse_inline,  # imported late: it reads these settings
            )

            parse_inline(value)
        return value

    @field_validator("concurrency")
    @classmethod
    def _concurrency(cls, value: str) -> str:
        if value.strip():
            from shared.scheduling.concurrency import parse_inline  # imported late, as above

            parse_inline(value)
        return value

    @field_validator("concurrency_file")
    @classmethod
    def _concurrency_file(cls, value: Path | None) -> Path | None:
        if value is not None:
            from shared.scheduling.concurrency import parse_file

            parse_file(value)
        return value

    @field_validator("prices_file")
    @classmethod
    def _prices_file(cls, value: Path | None) -> Path | None:
        if value is not None:
            from shared.pricing import load_file  # imported late: it reads these settings

            load_file(value)
        return value

    @field_validator("mcp_servers")
    @classmethod
    def _mcp_servers(cls, value: str) -> str:
        from shared.mcp.config import parse_inline  # imported late, as above

        parse_inline(value)
        return value

    @field_validator("mcp_servers_file")
    @classmethod
    def _mcp_servers_file(cls, value: Path | None) -> Path | None:
        if value is not None:
            from shared.mcp.config import parse_file

            parse_file(value)
        return value

    @field_validator("rate_limits_file")
    @classmethod
    def _rate_limits_file(cls, value: Path | None) -> Path | None:
        if value is not None:
            from shared.ratelimit.rules import parse_file  # imported late: it reads these settings

            parse_file(value)
        return value

    @property
    def effective_database_url(self) -> str:
        """The database to use: the configured one, else a SQLite file in the data directory."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'ratchet.db').resolve()}"

    @property
    def effective_broker_url(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def embedded(self) -> bool:
        """True when the queue runs in-process (``ratchet dev``)."""
        return self.effective_broker_url.startswith("memory://")


class _SettingsCache:
    """The process's one ``Settings``, made on first use; ``cache_clear()`` makes the next call
    read the environment again (tests and a CLI command that changes it).

    Unlike ``functools.lru_cache``, a ``Settings`` that was being made while the cache was
    cleared is not kept: it may have read the environment from before the change, and a thread
    that was reading it then (a background thread of the worker or the API) would otherwise
    hand every later caller the old settings."""

    def __init__(self) -> None:
        self._settings: Settings | None = None
        self._generation = 0
        self._lock = threading.Lock()

    def __call__(self) -> Settings:
        found = self._settings
        if found is not None:
            return found
        generation = self._generation
        made = Settings()
        with self._lock:
            if self._generation != generation:
                return made  # cleared meanwhile: good for this caller, not kept for the next
            if self._settings is None:
                self._settings = made
            return self._settings

    def cache_clear(self) -> None:
        with self._lock:
            self._generation += 1
            self._settings = None


get_settings = _SettingsCache()


def describe_invalid(exc: ValidationError | SettingsError) -> str:
    """One line naming each bad setting and what is wrong with it, for a process that stops."""
    if isinstance(exc, SettingsError):
        return " ".join(str(exc).split())
    problems = []
    for error in exc.errors():
        name, *rest = error["loc"] or ("settings",)
        where = f"RATCHET_{str(name).upper()}" + "".join(f"[{part}]" for part in rest)
        message = " ".join(error["msg"].removeprefix("Value error, ").split())
        problems.append(f"{where}: {message}")
    return "; ".join(problems)
