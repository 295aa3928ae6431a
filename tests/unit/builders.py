"""Builders for the unit tests: a task row as a write predicts it, and a lease on it.

Neither touches a database: a task is a plain namespace holding every column a write returns
(``fenced.FIELDS``), which is all that ``predict``, ``settle`` and ``next_lease`` read.
"""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from shared.statuses import TaskStatus
from shared.store.fenced import FIELDS
from shared.store.leases import Lease

CREATED = datetime(2025, 1, 1, tzinfo=UTC)
CLOCK_MS = 1_735_689_600_000  # the database clock when the lease below was taken
TTL_MS = 30_000

_DEFAULTS: dict[str, Any] = {
    "id": "task-1",
    "tenant_id": "tenant-1",
    "agent": "assistant",
    "model": "scripted",
    "status": TaskStatus.RUNNING,
    "input": "hello",
    "instructions": None,
    "tools": [],
    "model_options": {},
    "max_steps": 20,
    "budget": None,
    "webhook": None,
    "meta": {},
    "created_at": CREATED,
    "started_at": CREATED,
    "finished_at": None,
    "updated_at": CREATED,
    "steps": 0,
    "attempt": 1,
    "model_failures": 0,
    "waiting": None,
    "input_tokens": 0,
    "output_tokens": 0,
    "cached_input_tokens": 0,
    "cache_write_tokens": 0,
    "reasoning_tokens": 0,
    "cost_usd": 0.0,
    "result": None,
    "error": None,
    "pending_approval": None,
    "approval": None,
    "lease_epoch": 3,
    "lease_owner": "host:1:1",
    "lease_expires_ms": CLOCK_MS + TTL_MS,
    "due_ms": None,
    "deadline_ms": None,
    "admitted_ms": CLOCK_MS,
    "priority": 0,
    "run_at": None,
    "schedule_id": None,
    "cancel_requested_at": None,
    "last_event_seq": 5,
    "idempotency_key": None,
    "request_hash": None,
    "output_schema": None,
    "context": None,
    "forked_from": None,
    "agent_version": None,
    "thread_id": None,
    "turn": None,
    "turn_held": False,
    "rolled_back": False,
    "stream": None,
    "parent_id": None,
    "parent_call_id": None,
    "root_id": None,
    "depth": 0,
    "children_input_tokens": 0,
    "children_output_tokens": 0,
    "children_cost_usd": 0.0,
    "batch_id": None,
}


def task_state(**overrides: Any) -> Any:
    """A running task, leased at epoch 3 for its first step, with ``overrides`` applied."""
    unknown = set(overrides) - set(FIELDS)
    if unknown:
        raise TypeError(f"not task columns: {sorted(unknown)}")
    return SimpleNamespace(**(_DEFAULTS | overrides))


def lease_on(task: Any, **overrides: Any) -> Lease:
    """The lease that ``task`` (as ``task_state`` builds it) is held under."""
    values: dict[str, Any] = {
        "task_id": task.id,
        "epoch": task.lease_epoch,
        "owner": task.lease_owner or "host:1:1",
        "step": task.steps + 1,
        "attempt": task.attempt,
        "ttl_ms": TTL_MS,
        "tenant_id": task.tenant_id,
        "clock_ms": CLOCK_MS,
        "task": task,
    }
    return Lease(**(values | overrides))


def db_row(*, clock_ms: int, last_event_seq: int) -> SimpleNamespace:
    """What a fenced write's RETURNING hands back: the event seq and the database clock."""
    return SimpleNamespace(id="task-1", last_event_seq=last_event_seq, clock_ms=clock_ms)
