"""The public shape of a task: the JSON that the API returns, events carry and webhooks send."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Protocol

from pydantic import BaseModel, Field, WithJsonSchema

from shared.pricing import is_priced


class Usage(BaseModel):
    """Tokens and cost of a task's (or a step's) model calls."""

    input_tokens: int = Field(0, description="the whole prompt, cached tokens included")
    output_tokens: int = Field(0, description="the answers, reasoning tokens included")
    cached_input_tokens: int = Field(
        0, description="of the input tokens, read from the provider's prompt cache"
    )
    cache_write_tokens: int = Field(
        0, description="of the input tokens, written to the provider's prompt cache"
    )
    reasoning_tokens: int = Field(0, description="of the output tokens, spent reasoning")
    cost_usd: float | None = Field(
        0.0,
        description="at list prices (see RATCHET_PRICES_FILE); null when the model has no "
        "known price",
    )


def usage_of(row: UsageRow, *, model: str) -> Usage:
    """A task's or a step's usage, as read. An unpriced model's calls were recorded at $0: its
    cost is unknown (null), not zero (unless a priced call, a summary's, added some)."""
    cost = row.cost_usd
    return Usage(
        input_tokens=row.input_tokens,
        output_tokens=row.output_tokens,
        # A row inserted a moment ago holds None where the database put its default (0).
        cached_input_tokens=row.cached_input_tokens or 0,
        cache_write_tokens=row.cache_write_tokens or 0,
        reasoning_tokens=row.reasoning_tokens or 0,
        cost_usd=round(cost, 8) if cost or is_priced(model) else None,
    )


class UsageRow(Protocol):
    """What a task's or a step's row holds of its usage."""

    @property
    def input_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def cached_input_tokens(self) -> int: ...
    @property
    def cache_write_tokens(self) -> int: ...
    @property
    def reasoning_tokens(self) -> int: ...
    @property
    def cost_usd(self) -> float: ...


# Said in the OpenAPI document: what ``output`` holds depends on the task's output_schema.
TaskResult = Annotated[
    dict[str, Any] | None,
    WithJsonSchema(
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "output": {
                            "description": "the final answer: its text, or, when the task had "
                            "an `output_schema`, the JSON value it parsed as (which met the "
                            "schema)",
                        }
                    },
                    "required": ["output"],
                },
                {"type": "null"},
            ],
            "description": '`{"output": …}` once the task succeeded, else null',
        }
    ),
]


class ForkOrigin(BaseModel):
    """Where a fork comes from: it holds that task's steps 1..``step`` as committed there."""

    task_id: str
    step: int = Field(description="the last of the origin's steps the fork kept")
    replaced_input: bool = Field(description="whether the fork replaced the user input")
    replaced_tool_results: list[str] = Field(
        description="the provider call ids of step `step` whose results the fork replaced"
    )


class TaskView(BaseModel):
    id: str
    status: str
    agent: str
    model: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    steps: int
    attempt: int
    usage: Usage
    result: TaskResult
    error: dict[str, Any] | None
    pending_approval: dict[str, Any] | None
    # A cancel asked for while a step was in flight, until the task is cancelled.
    cancel_requested_at: datetime | None = None
    priority: int = 0
    # Not before then (asked for at submission), and the schedule that fired it, if one did.
    run_at: datetime | None = None
    schedule_id: str | None = None
    metadata: dict[str, Any]
    forked_from: ForkOrigin | None = Field(
        None,
        description="a fork's origin (`POST /v1/tasks/{id}/fork`); null for a task that is no fork",
    )
    agent_version: str | None = Field(
        None,
        description="the agent version the task runs (GET /v1/agents/{agent}/versions/{id}), "
        "pinned when it was submitted; null for a task from before versions were pinned",
    )
    # A thread's turn: its thread and its number there.
    thread_id: str | None = None
    turn: int | None = None
    parent_id: str | None = Field(
        None, description="the task whose sub-agent call started this one; null for a root"
    )
    root_id: str | None = Field(
        None, description="the root of its tree of tasks (its own id for a root)"
    )
    children_usage: Usage | None = Field(
        None,
        description="what its settled sub-agent tasks used (theirs and their children's); "
        "`usage` counts it too. Null for a task with none",
    )
    waiting: dict[str, Any] | None = Field(
        None,
        description="while `waiting`: the step and its calls' pending waits (tokens, children)",
    )
    batch_id: str | None = Field(
        None, description="the batch it was submitted in (`GET /v1/batches/{id}`), if any"
    )


def aware(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every time Ratchet stores is UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


class TaskState(UsageRow, Protocol):
    """A task as read: an ORM Task, or a row returned by a write (``fenced.TASK_COLUMNS``)."""

    @property
    def id(self) -> str: ...
    @property
    def tenant_id(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def agent(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def input(self) -> Any: ...
    @property
    def instructions(self) -> str | None: ...
    @property
    def tools(self) -> list[Any]: ...
    @property
    def model_options(self) -> dict[str, Any]: ...
    @property
    def max_steps(self) -> int: ...
    @property
    def budget(self) -> dict[str, Any] | None: ...
    @property
    def context(self) -> dict[str, Any] | None: ...
    @property
    def webhook(self) -> dict[str, Any] | None: ...
    @property
    def meta(self) -> dict[str, Any]: ...
    @property
    def created_at(self) -> datetime: ...
    @property
    def updated_at(self) -> datetime: ...
    @property
    def started_at(self) -> datetime | None: ...
    @property
    def finished_at(self) -> datetime | None: ...
    @property
    def steps(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def result(self) -> dict[str, Any] | None: ...
    @property
    def error(self) -> dict[str, Any] | None: ...
    @property
    def pending_approval(self) -> dict[str, Any] | None: ...
    @property
    def approval(self) -> dict[str, Any] | None: ...
    @property
    def deadline_ms(self) -> int | None: ...
    @property
    def cancel_requested_at(self) -> datetime | None: ...
    @property
    def model_failures(self) -> int: ...
    @property
    def waiting(self) -> dict[str, Any] | None: ...
    @property
    def last_event_seq(self) -> int: ...
    @property
    def lease_epoch(self) -> int: ...
    @property
    def lease_owner(self) -> str | None: ...
    @property
    def lease_expires_ms(self) -> int | None: ...
    @property
    def priority(self) -> int: ...
    @property
    def run_at(self) -> datetime | None: ...
    @property
    def schedule_id(self) -> str | None: ...
    @property
    def output_schema(self) -> dict[str, Any] | None: ...
    @property
    def forked_from(self) -> dict[str, Any] | None: ...
    @property
    def agent_version(self) -> str | None: ...
    @property
    def thread_id(self) -> str | None: ...
    @property
    def turn(self) -> int | None: ...
    @property
    def stream(self) -> bool | None: ...
    @property
    def parent_id(self) -> str | None: ...
    @property
    def parent_call_id(self) -> str | None: ...
    @property
    def root_id(self) -> str | None: ...
    @property
    def depth(self) -> int: ...
    @property
    def children_input_tokens(self) -> int: ...
    @property
    def children_output_tokens(self) -> int: ...
    @property
    def children_cost_usd(self) -> float: ...
    @property
    def batch_id(self) -> str | None: ...


def task_view(task: TaskState, *, approval_links: bool = False) -> TaskView:
    """The task as a client reads it. Each waiting call's ``approval_url`` decides it without
    a key, so it is kept only for a reader who may decide (``approval_links``): left out by
    default, so a path that does not ask never hands the link out."""
    created_at = aware(task.created_at)
    assert created_at is not None
    return TaskView(
        id=task.id,
        status=task.status,
        agent=task.agent,
        model=task.model,
        created_at=created_at,
        started_at=aware(task.started_at),
        finished_at=aware(task.finished_at),
        steps=task.steps,
        attempt=task.attempt,
        usage=usage_of(_with_children(task), model=task.model),
        children_usage=_children_usage(task),
        parent_id=task.parent_id,
        root_id=task.root_id or task.id,
        waiting=_waits_of(task, links=approval_links),
        result=task.result,
        error=task.error,
        pending_approval=(
            task.pending_approval if approval_links else without_links(task.pending_approval)
        ),
        cancel_requested_at=aware(task.cancel_requested_at),
        priority=task.priority,
        run_at=aware(task.run_at),
        schedule_id=task.schedule_id,
        metadata=task.meta,
        forked_from=ForkOrigin.model_validate(task.forked_from) if task.forked_from else None,
        agent_version=task.agent_version,
        thread_id=task.thread_id,
        turn=task.turn,
        batch_id=task.batch_id,
    )


class _Totals:
    """A task's usage with its settled children's added (a ``UsageRow``)."""

    def __init__(self, task: TaskState) -> None:
        self.input_tokens = task.input_tokens + (task.children_input_tokens or 0)
        self.output_tokens = task.output_tokens + (task.children_output_tokens or 0)
        self.cached_input_tokens = task.cached_input_tokens
        self.cache_write_tokens = task.cache_write_tokens
        self.reasoning_tokens = task.reasoning_tokens
        self.cost_usd = task.cost_usd + (task.children_cost_usd or 0.0)


def _with_children(task: TaskState) -> UsageRow:
    if not (task.children_input_tokens or task.children_output_tokens or task.children_cost_usd):
        return task
    return _Totals(task)


def _children_usage(task: TaskState) -> Usage | None:
    if not (task.children_input_tokens or task.children_output_tokens or task.children_cost_usd):
        return None
    return Usage(
        input_tokens=task.children_input_tokens,
        output_tokens=task.children_output_tokens,
        cost_usd=round(task.children_cost_usd, 8),
    )


def _waits_of(task: TaskState, *, links: bool) -> dict[str, Any] | None:
    """What a waiting task waits for; the waits' signed URLs only for a reader who may
    complete them (as with approval links)."""
    waiting = task.waiting
    if task.status != "waiting" or not waiting or "waits" not in waiting:
        return None
    if links:
        return waiting
    return waiting | {
        "waits": [{k: v for k, v in w.items() if k != "url"} for w in waiting["waits"]]
    }


def task_document(task: TaskState) -> dict[str, Any]:
    """The task as the event log stores it: whole, approval links included. Whoever hands a
    stored document on strips them for a receiver who may not decide (``document_without_links``:
    the event stream, webhooks)."""
    return task_view(task, approval_links=True).model_dump(mode="json")


def without_links(pending: dict[str, Any] | None) -> dict[str, Any] | None:
    """``pending_approval`` without the calls' ``approval_url`` (a copy; ``pending`` is kept)."""
    if not pending or not any("approval_url" in c for c in pending.get("calls", ())):
        return pending
    calls = [{k: v for k, v in c.items() if k != "approval_url"} for c in pending["calls"]]
    return pending | {"calls": calls}


def document_without_links(data: dict[str, Any]) -> dict[str, Any]:
    """An event's data with no link that acts without a key: a Task document's
    ``pending_approval`` links and its waits' signed URLs, or a parked call's (a copy when
    there was one to strip; any other data as it is)."""
    pending = data.get("pending_approval")
    if isinstance(pending, dict):
        stripped = without_links(pending)
        if stripped is not pending:
            data = data | {"pending_approval": stripped}
    waiting = data.get("waiting")
    if isinstance(waiting, dict) and any("url" in w for w in waiting.get("waits", ())):
        waits = [{k: v for k, v in w.items() if k != "url"} for w in waiting["waits"]]
        data = data | {"waiting": waiting | {"waits": waits}}
    wait = data.get("wait")
    if isinstance(wait, dict) and "url" in wait:
        data = data | {"wait": {k: v for k, v in wait.items() if k != "url"}}
    return data
