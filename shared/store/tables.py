"""The tables. ORM models are storage, never API schemas."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    bindparam,
    false,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.sql.elements import ColumnElement

from shared.statuses import RUNNABLE_STATUSES, TaskStatus, in_order

JSONType = JSON().with_variant(JSONB(), "postgresql")


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {  # noqa: RUF012 - SQLAlchemy reads it as given
        dict[str, Any]: JSONType,
        list[Any]: JSONType,
        datetime: DateTime(timezone=True),
    }


_RUNNABLE_SQL = "(" + ", ".join(f"'{status}'" for status in in_order(RUNNABLE_STATUSES)) + ")"
_UNDECIDED_SQL = "decision IS NULL AND approval_deadline_ms IS NOT NULL"


def _where(sql: str) -> dict[str, Any]:
    """A partial index's predicate, on both backends."""
    return {"postgresql_where": text(sql), "sqlite_where": text(sql)}


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[list[Any]]
    name: Mapped[str | None] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime | None]
    # Written at most once a minute per key (see tenants.authenticate), not on every request.
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class DashboardSession(Base):
    """A dashboard login: an API key exchanged for a cookie. Only the cookie's hash is kept;
    the session ends with its key (revoked, expired or deleted) or at ``expires_at``."""

    __tablename__ = "dashboard_sessions"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    csrf_token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]


class Task(Base):
    __tablename__ = "tasks"
    __table_args__ = (
        # Only the tasks that have a key (most have none): fewer entries to write per update.
        Index(
            "uq_tasks_tenant_idempotency_key",
            "tenant_id",
            "idempotency_key",
            unique=True,
            **_where("idempotency_key IS NOT NULL"),
        ),
        Index("ix_tasks_tenant_id_id", "tenant_id", "id"),
        Index("ix_tasks_tenant_status_id", "tenant_id", "status", "id"),
        Index("ix_tasks_status_due", "status", "due_ms"),
        # The dashboard's time windows (submitted and finished per minute, recent durations).
        Index("ix_tasks_created_at", "created_at"),
        Index(
            "ix_tasks_finished_at",
            "finished_at",
            **_where("finished_at IS NOT NULL"),
        ),
        # The dispatcher's two questions (shared.scheduling): what each tenant has waiting, in
        # the order it is admitted, and what is admitted now. Both stay as small as those sets.
        Index(
            "ix_tasks_backlog",
            "tenant_id",
            text("priority DESC"),
            "due_ms",
            **_where(f"admitted_ms IS NULL AND status IN {_RUNNABLE_SQL}"),
        ),
        Index(
            "ix_tasks_admitted",
            "tenant_id",
            **_where(f"admitted_ms IS NOT NULL AND status IN {_RUNNABLE_SQL}"),
        ),
        Index(
            "uq_tasks_parent_call",
            "parent_id",
            "parent_call_id",
            unique=True,
            **_where("parent_id IS NOT NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    agent: Mapped[str] = mapped_column(String(100))
    model: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(32), default=TaskStatus.QUEUED)
    input: Mapped[Any] = mapped_column(JSONType)
    instructions: Mapped[str | None] = mapped_column(Text)
    tools: Mapped[list[Any]]
    model_options: Mapped[dict[str, Any]]
    max_steps: Mapped[int]
    budget: Mapped[dict[str, Any] | None]
    webhook: Mapped[dict[str, Any] | None]
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSONType)
    output_schema: Mapped[dict[str, Any] | None]  # JSON Schema the final answer must meet
    context: Mapped[dict[str, Any] | None]  # the context-window policy: {"policy": …}
    # Live token streaming: whether its model calls stream (None: its agent's choice, else
    # RATCHET_STREAM_DEFAULT).
    stream: Mapped[bool | None]

    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)

    steps: Mapped[int] = mapped_column(default=0)
    attempt: Mapped[int] = mapped_column(default=0)
    model_failures: Mapped[int] = mapped_column(default=0)  # failed model calls at this step
    waiting: Mapped[dict[str, Any] | None]  # why the current step is waiting, if it is
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # Of the input tokens: read from the provider's prompt cache, and written to it; of the
    # output tokens: spent on reasoning.
    cached_input_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    cache_write_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    cost_usd: Mapped[float] = mapped_column(Float, default=0.0)
    result: Mapped[dict[str, Any] | None]
    error: Mapped[dict[str, Any] | None]
    pending_approval: Mapped[dict[str, Any] | None]
    # The submission's approval policy: {"tools": [...], "timeout_seconds": n, "on_timeout": …}
    approval: Mapped[dict[str, Any] | None]

    # Leases: a worker owns the task while lease_expires_ms (database clock) is in the future.
    lease_epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_ms: Mapped[int | None] = mapped_column(BigInteger)
    # When the next step should run; the sweeper re-enqueues runnable tasks long past due.
    due_ms: Mapped[int | None] = mapped_column(BigInteger)
    deadline_ms: Mapped[int | None] = mapped_column(BigInteger)
    # Scheduling: a runnable task waits in the backlog (admitted_ms NULL) until the dispatcher
    # admits it to the queue; admitted, it holds a slot of every concurrency limit it falls
    # under until it ends or waits (a backoff, an approval). priority orders a tenant's own.
    admitted_ms: Mapped[int | None] = mapped_column(BigInteger)
    priority: Mapped[int] = mapped_column(SmallInteger, default=0, server_default="0")
    run_at: Mapped[datetime | None]  # asked for at submission: not before then
    schedule_id: Mapped[str | None] = mapped_column(String(36))  # the schedule that fired it
    cancel_requested_at: Mapped[datetime | None]  # a cancel asked for and not landed yet
    last_event_seq: Mapped[int] = mapped_column(default=0)

    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str | None] = mapped_column(String(64))

    # Forks (shared.store.forks): the task and step this one was forked from, and what it
    # replaced there ({"task_id", "step", "replaced_input", "replaced_tool_results"}).
    forked_from: Mapped[dict[str, Any] | None]
    # The agent version it runs (``agent_versions.id``), pinned at submission; NULL for a task
    # older than pinning, which runs its agent as the live registry has it. No foreign key: a
    # key's check would lock the version's row for every insert of a task, and every task of
    # an agent shares it; the version row is committed before any task names it.
    agent_version: Mapped[str | None] = mapped_column(String(64))
    # A thread's turn (see Thread, below): its thread and number there, from 1; held while an
    # earlier turn is unfinished; rolled back (out of the thread's history, rows kept).
    thread_id: Mapped[str | None] = mapped_column(
        ForeignKey("threads.id", ondelete="CASCADE", name="fk_tasks_thread_id")
    )
    turn: Mapped[int | None] = mapped_column(Integer)
    turn_held: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    rolled_back: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # A sub-agent's task (shared.store.families): the task whose call started it, that call,
    # the root of its tree (NULL for a root: it is its own) and its depth below it (0: a
    # root). One child per parent's call (``uq_tasks_parent_call``).
    parent_id: Mapped[str | None] = mapped_column(
        ForeignKey("tasks.id", ondelete="CASCADE", name="fk_tasks_parent_id")
    )
    parent_call_id: Mapped[str | None] = mapped_column(String(100))
    root_id: Mapped[str | None] = mapped_column(String(36))
    depth: Mapped[int] = mapped_column(SmallInteger, default=0, server_default="0")
    # What its settled children used (theirs and their own children's): a task's usage, and
    # the budget it is held to, count them with its own.
    children_input_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0", default=0)
    children_output_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0", default=0)
    children_cost_usd: Mapped[float] = mapped_column(Float, server_default="0", default=0.0)
    # The batch it was submitted in (``POST /v1/tasks/batch``), if it was.
    batch_id: Mapped[str | None] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE", name="fk_tasks_batch_id")
    )


def runnable() -> ColumnElement[bool]:
    """``tasks.status IN ('queued', 'running')`` with the values written into the SQL, not
    bound: sessions plan generically, and a generic plan can use a partial index only when
    the query names its predicate's values (``ix_tasks_backlog``, ``ix_tasks_admitted``);
    with bound values the backlog's queries read every runnable task instead."""
    statuses = in_order(RUNNABLE_STATUSES)
    return Task.status.in_(bindparam("runnable", statuses, expanding=True, literal_execute=True))


class Step(Base):
    """One step's checkpoint: the model's response, written once, before any tool runs; its
    completion sets only its last column (see ``checkpoints.status``)."""

    __tablename__ = "steps"

    task_id: Mapped[str] = mapped_column(
        ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True
    )
    number: Mapped[int] = mapped_column(Integer, primary_key=True)
    response: Mapped[dict[str, Any]]
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_input_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    cache_write_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    cost_usd: Mapped[float] = mapped_column(Float, default=0.0)
    model_latency_ms: Mapped[int] = mapped_column(default=0)
    lease_epoch: Mapped[int] = mapped_column(BigInteger)
    started_at: Mapped[datetime]
    model_completed_at: Mapped[datetime]
    completed_at: Mapped[datetime | None]


class ToolCall(Base):
    """The tool-call ledger: one row per call, keyed by (task, call id)."""

    __tablename__ = "tool_calls"
    __table_args__ = (
        # The sweeper's look for approvals past their deadline: undecided calls only, and no
        # status in it, so a call's outcome is written in place (HOT).
        Index("ix_tool_calls_undecided", "approval_deadline_ms", **_where(_UNDECIDED_SQL)),
    )

    task_id: Mapped[str] = mapped_column(
        ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True
    )
    step_number: Mapped[int]
    position: Mapped[int]
    call_id: Mapped[str] = mapped_column(String(100), primary_key=True)
    provider_call_id: Mapped[str] = mapped_column(String(200))
    tool: Mapped[str] = mapped_column(String(100))
    arguments: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16))
    result: Mapped[Any | None] = mapped_column(JSONType)
    error: Mapped[str | None] = mapped_column(Text)
    runs: Mapped[int] = mapped_column(default=1)
    lease_epoch: Mapped[int] = mapped_column(BigInteger)
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    # A call that waits for a person (status "awaiting"): its deadline and what happens then,
    # and once decided: approve, edit or reject, by whom, when and why. An edit keeps the
    # model's own arguments in ``original_arguments``.
    approval_deadline_ms: Mapped[int | None] = mapped_column(BigInteger)
    approval_on_timeout: Mapped[str | None] = mapped_column(String(16))
    decision: Mapped[str | None] = mapped_column(String(16))
    decided_by: Mapped[str | None] = mapped_column(String(200))
    decided_at: Mapped[datetime | None]
    decision_reason: Mapped[str | None] = mapped_column(Text)
    original_arguments: Mapped[dict[str, Any] | None]
    # Forks: a call a fork inherited names the task that ran it (whose idempotency key it ran
    # with); NULL for the task's own calls.
    inherited_from: Mapped[str | None] = mapped_column(String(36))


class Summary(Base):
    """A summary the ``summarize`` context policy committed: in the prompt it stands for the
    task's conversation through ``through_step`` (after the first user message), and it builds
    on the summary before it. Written once; a crash never recomputes it."""

    __tablename__ = "summaries"

    task_id: Mapped[str] = mapped_column(
        ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True
    )
    number: Mapped[int] = mapped_column(Integer, primary_key=True)
    through_step: Mapped[int]
    content: Mapped[str] = mapped_column(Text)
    model: Mapped[str] = mapped_column(String(200))
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cost_usd: Mapped[float] = mapped_column(Float, default=0.0)
    lease_epoch: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class TaskEvent(Base):
    __tablename__ = "task_events"

    task_id: Mapped[str] = mapped_column(
        ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    type: Mapped[str] = mapped_column(String(64))
    data: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WebhookSecret(Base):
    """A tenant's signing secrets: the newest signs; older ones keep signing until they expire
    (the rotation overlap), so receivers can switch without missing a message."""

    __tablename__ = "webhook_secrets"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    secret: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime | None]


class WebhookEndpoint(Base):
    """A tenant's default endpoint: receives the listed events of every task of the tenant."""

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(String(2048))
    events: Mapped[list[Any]]
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    disabled_reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # The circuit breaker (shared.webhooks.circuits): failed attempts in a row; ``closed``,
    # ``open`` (held back until circuit_until_ms) or ``half_open`` (one probe out, whose
    # claim on the probe runs out at circuit_until_ms). Times are the database's clock.
    consecutive_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    circuit_state: Mapped[str] = mapped_column(
        String(16), default="closed", server_default="closed"
    )
    circuit_until_ms: Mapped[int | None] = mapped_column(BigInteger)


class WebhookDelivery(Base):
    """The outbox: one row per (event, endpoint), written in the event's transaction."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index("ix_webhook_deliveries_task", "task_id", "id"),
        Index("ix_webhook_deliveries_due", "status", "next_attempt_ms"),
        Index("ix_webhook_deliveries_endpoint", "endpoint_id", "created_at"),
        # The overview's count of failures in a window, however long the history.
        Index(
            "ix_webhook_deliveries_failed",
            "created_at",
            **_where("status IN ('failed', 'disabled')"),
        ),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"))
    endpoint_id: Mapped[str | None] = mapped_column(String(36))
    event_seq: Mapped[int]
    event_type: Mapped[str] = mapped_column(String(64))
    url: Mapped[str] = mapped_column(String(2048))
    payload: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(default=0)
    attempts_base: Mapped[int] = mapped_column(default=0)  # attempts before the last redeliver
    next_attempt_ms: Mapped[int | None] = mapped_column(BigInteger)
    claim_expires_ms: Mapped[int | None] = mapped_column(BigInteger)
    last_status_code: Mapped[int | None]
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None]


class WebhookAttempt(Base):
    __tablename__ = "webhook_attempts"

    delivery_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), primary_key=True
    )
    number: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[datetime]
    status_code: Mapped[int | None]
    latency_ms: Mapped[int]
    error: Mapped[str | None] = mapped_column(Text)


class ConcurrencyLimit(Base):
    """An operator's runtime setting of a concurrency limit; it overrides the settings' and the
    file's for the same scope (``kind``: tenant, agent or pool; ``name``: the tenant's name,
    the agent, the pool, or ``*``)."""

    __tablename__ = "concurrency_limits"

    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    spec: Mapped[dict[str, Any]]  # max_running, max_queued, weight, match (pools)
    updated_by: Mapped[str] = mapped_column(String(200))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class Schedule(Base):
    """A task body submitted on a cron expression in a time zone; ``next_fire_ms`` is its next
    tick, moved on in the transaction that creates the tick's task."""

    __tablename__ = "schedules"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name", name="uq_schedules_tenant_name"),
        Index("ix_schedules_due", "next_fire_ms", postgresql_where=text("NOT paused")),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(100))
    cron: Mapped[str] = mapped_column(String(200))
    timezone: Mapped[str] = mapped_column(String(64))
    body: Mapped[dict[str, Any]]  # the submission, as POST /v1/tasks takes it
    catch_up: Mapped[str] = mapped_column(String(16))  # a missed tick: "run_once" or "skip"
    paused: Mapped[bool] = mapped_column(Boolean, default=False)
    next_fire_ms: Mapped[int] = mapped_column(BigInteger)
    last_fired_ms: Mapped[int | None] = mapped_column(BigInteger)
    last_task_id: Mapped[str | None] = mapped_column(String(36))
    fired: Mapped[int] = mapped_column(BigInteger, default=0)
    skipped: Mapped[int] = mapped_column(BigInteger, default=0)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_by: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Leader(Base):
    """Who leads a fleet-wide duty (the dispatch) until when (database clock): the holder
    renews it while it lives; once it runs out, any process may take it."""

    __tablename__ = "leaders"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(200))
    expires_ms: Mapped[int] = mapped_column(BigInteger)


class AgentVersion(Base):
    """An agent's definition as tasks ran it (system prompt, tools with their descriptions,
    schemas and metadata, limits), content-addressed: ``id`` is the SHA-256 of its canonical
    JSON (``shared.agents.versions``), so the same definition is one row however often it is
    submitted, and a row never changes."""

    __tablename__ = "agent_versions"
    __table_args__ = (Index("ix_agent_versions_agent_created", "agent", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    agent: Mapped[str] = mapped_column(String(100))
    definition: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)  # first submitted


# --- Threads ------------------------------------------------------------------------------

_UNFINISHED_SQL = "status NOT IN ('succeeded', 'failed', 'cancelled')"


class Thread(Base):
    """A conversation: its turns are tasks (``tasks.thread_id``, ``tasks.turn``), and its
    history is their committed steps (and a fork's, its source's up to ``fork_turn``), never
    a copy. ``turns`` counts the turns numbered so
    far; taking the next number is what serializes two turns sent at once."""

    __tablename__ = "threads"
    __table_args__ = (
        Index("ix_threads_tenant_id_id", "tenant_id", "id"),
        Index("ix_threads_forked_from", "forked_from", **_where("forked_from IS NOT NULL")),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    agent: Mapped[str] = mapped_column(String(100))
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSONType)
    turns: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # A fork: its history holds this thread's turns 1..fork_turn (read there, never copied),
    # and its own turns are numbered after them. A thread with forks is not deleted.
    forked_from: Mapped[str | None] = mapped_column(
        ForeignKey("threads.id", name="fk_threads_forked_from")
    )
    fork_turn: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


# One number per turn; at most one turn of a thread unfinished and not held (two turns never
# run at once, guarded here rather than by the code that releases them); the held turns, few.
Index(
    "uq_tasks_thread_turn",
    Task.thread_id,
    Task.turn,
    unique=True,
    **_where("thread_id IS NOT NULL"),
)
Index(
    "uq_tasks_thread_running",
    Task.thread_id,
    unique=True,
    **_where(f"thread_id IS NOT NULL AND NOT turn_held AND {_UNFINISHED_SQL}"),
)
Index("ix_tasks_held", Task.thread_id, Task.turn, **_where("turn_held"))


class Wait(Base):
    """A tool call parked on the outside world (``kind`` "token": completed by
    ``POST /v1/waits/{token}``) or on a child task (``kind`` "child"), until it is settled
    once: ``pending → completed | failed | expired | cancelled``. Its task is ``waiting``
    while any of its step's waits is pending, and holds no lease, slot or worker."""

    __tablename__ = "waits"
    __table_args__ = (
        UniqueConstraint("task_id", "call_id", name="uq_waits_task_call"),
        Index("ix_waits_pending_deadline", "deadline_ms", **_where("status = 'pending'")),
        Index("ix_waits_pending_child", "child_id", **_where("status = 'pending'")),
    )

    token: Mapped[str] = mapped_column(String(64), primary_key=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(String(36))
    call_id: Mapped[str] = mapped_column(String(100))
    step_number: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))
    child_id: Mapped[str | None] = mapped_column(String(36))
    status: Mapped[str] = mapped_column(String(16))
    # What the tool said it waits for (shown to whoever completes it), and the completion's
    # JSON body or the child's result: the call's result; or why it failed.
    request: Mapped[Any | None] = mapped_column(JSONType)
    payload: Mapped[Any | None] = mapped_column(JSONType)
    error: Mapped[str | None] = mapped_column(Text)
    deadline_ms: Mapped[int | None] = mapped_column(BigInteger)
    on_timeout: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    settled_at: Mapped[datetime | None]
    settled_by: Mapped[str | None] = mapped_column(String(200))


class Batch(Base):
    """Tasks submitted in one request (``POST /v1/tasks/batch``), in one transaction. It keeps
    its answer for each item (``{"task_id": …}`` or ``{"error": <problem>}``, in the request's
    order) so a repeat of the request (its Idempotency-Key, the same body) answers the same
    and creates nothing. Its tasks name it (``Task.batch_id``)."""

    __tablename__ = "batches"
    __table_args__ = (
        Index(
            "uq_batches_tenant_idempotency_key",
            "tenant_id",
            "idempotency_key",
            unique=True,
            **_where("idempotency_key IS NOT NULL"),
        ),
        Index("ix_batches_tenant_id_id", "tenant_id", "id"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    task_count: Mapped[int] = mapped_column(Integer)  # the tasks it created
    refused_count: Mapped[int] = mapped_column(Integer)  # items refused, each with its error
    items: Mapped[list[Any]]
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str | None] = mapped_column(String(64))


# A batch's tasks, for its progress; only tasks submitted in a batch are in it.
Index("ix_tasks_batch", Task.batch_id, **_where("batch_id IS NOT NULL"))


class Secret(Base):
    """A tenant's secret: its value a Fernet token (shared/vault.py), never the value itself.
    One per (tenant, name); setting it again replaces the value."""

    __tablename__ = "secrets"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_secrets_tenant_name"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    ciphertext: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class AuditEntry(Base):
    """Who changed a tenant's sensitive settings, and when: a secret set or deleted, an MCP
    server added or removed. Names what changed, never a value."""

    __tablename__ = "audit_log"
    __table_args__ = (Index("ix_audit_log_tenant_at", "tenant_id", "at"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(default=utcnow)
    # ``key:<api key id>`` over the API, ``cli`` for the operator's commands.
    actor: Mapped[str] = mapped_column(String(100))
    action: Mapped[str] = mapped_column(String(32))  # e.g. secret.set, secret.delete
    target: Mapped[str] = mapped_column(String(200))  # the secret's name, the server's name


class TenantMcpServer(Base):
    """An MCP server a tenant registered (Streamable HTTP only): its tools are open to that
    tenant's tasks alone, as ``<name>.<tool>``. Its headers may name the tenant's secrets
    (``${secret:NAME}``, resolved when a process connects); they are kept encrypted, like the
    secrets, since a header may hold a credential itself."""

    __tablename__ = "tenant_mcp_servers"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name", name="uq_tenant_mcp_servers_tenant_name"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    url: Mapped[str] = mapped_column(String(2048))
    # A Fernet token of the headers' JSON; None when there are none.
    headers_ciphertext: Mapped[str | None] = mapped_column(Text)
    header_names: Mapped[list[Any]]  # to show them: names only, never a value
    timeout_seconds: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
