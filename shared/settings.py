"""The one settings object, read from ``RATCHET_*`` environment variables or ``.env``."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

CommaList = Annotated[list[str], NoDecode]


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

    lease_ttl_seconds: float = Field(30.0, gt=0)
    max_step_attempts: int = Field(5, ge=1)
    visibility_timeout_seconds: int = Field(3600, ge=60)
    step_time_limit_seconds: int = Field(900, ge=10)
    shutdown_grace_seconds: float = Field(20.0, ge=0)
    worker_metrics_port: int = Field(0, ge=0, le=65535)  # 0: no metrics server
    # Steps one worker process runs at once: a step waiting on its model or a tool holds one
    # of these threads and nothing scarcer (no database connection, no Celery slot).
    worker_threads: int = Field(256, ge=1, le=4096)
    # Database connections per process (the pool, and how far past it a burst may go); the
    # lease heartbeat has one more of its own.
    db_pool_size: int = Field(6, ge=1, le=100)
    db_pool_overflow: int = Field(1, ge=0, le=100)
    sweep_interval_seconds: float = Field(5.0, gt=0)
    sweep_grace_seconds: float = Field(30.0, ge=0)

    model_timeout_seconds: float = Field(60.0, gt=0)
    model_max_attempts: int = Field(5, ge=1)
    model_retry_base_seconds: float = Field(0.5, ge=0)
    model_retry_inline_max_seconds: float = Field(5.0, ge=0)
    openai_base_url: str | None = None
    openai_api_key: SecretStr | None = None
    anthropic_base_url: str | None = None
    anthropic_api_key: SecretStr | None = None

    rate_limits: str = ""
    rate_limits_file: Path | None = None
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
    webhook_retry_schedule: Annotated[list[float], NoDecode] = [
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
    tool_timeout_seconds: float = Field(60.0, gt=0)

    _split = field_validator(
        "agent_modules",
        "http_allowed_hosts",
        "webhook_allowed_hosts",
        "webhook_retry_schedule",
        mode="before",
    )(_split_commas)

    @field_validator("database_url")
    @classmethod
    def _psycopg_driver(cls, value: str) -> str:
        # Accept the usual libpq-style URL and point SQLAlchemy at psycopg 3.
        for prefix in ("postgres://", "postgresql://"):
            if value.startswith(prefix):
                return "postgresql+psycopg://" + value[len(prefix) :]
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


@lru_cache
def get_settings() -> Settings:
    return Settings()
