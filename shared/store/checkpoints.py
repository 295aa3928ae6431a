"""The checkpoint store: one row per step, holding that step's model response.

A step's row is written once, when the model has answered and before any tool runs, so a
committed model call is never made again. Rows hold only the step's own output: writes do
not grow with the conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, cast

from sqlalchemy import Table, select
from sqlalchemy.orm import Session

from shared.store.batch import Add, Change
from shared.store.leases import Lease
from shared.store.tables import Step, ToolCall, utcnow

_STEPS = cast(Table, Step.__table__)


class StepStatus(StrEnum):
    """A step's status, derived from its row (not stored): the model answered, then it
    completed."""

    MODEL_RESPONDED = "model_responded"
    COMPLETED = "completed"


@dataclass(frozen=True)
class ModelCall:
    response: dict[str, Any]
    input_tokens: int
    output_tokens: int
    cost_usd: float
    latency_ms: int
    started_at: datetime
    # Within the tokens above: read from and written to the prompt cache; spent reasoning.
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0
    # The prompt as sent, in tokens: the provider's count, else Ratchet's own before the call.
    prompt_tokens: int = 0


def load_steps(
    session: Session, task_id: str, *, after: int = 0, limit: int | None = None
) -> Sequence[Step]:
    query = select(Step).where(Step.task_id == task_id, Step.number > after).order_by(Step.number)
    if limit is not None:
        query = query.limit(limit)
    return session.scalars(query).all()


def load_history(session: Session, task_id: str) -> tuple[list[Step], list[ToolCall]]:
    """Every step of the task and every tool call, in order, in one round trip."""
    rows = session.execute(
        select(Step, ToolCall)
        .outerjoin(
            ToolCall, (ToolCall.task_id == Step.task_id) & (ToolCall.step_number == Step.number)
        )
        .where(Step.task_id == task_id)
        .order_by(Step.number, ToolCall.position)
    ).all()
    steps = list({id(step): step for step, _ in rows}.values())
    calls = [call for _, call in rows if call is not None]
    return steps, calls


def save_model_response(lease: Lease, call: ModelCall, *, final: bool = False) -> Add:
    """The checkpoint of the model's answer for ``lease.step``, written with a fenced write.

    A ``final`` answer (no tool calls) completes its step in the same write.
    """
    now = utcnow()
    return Add(
        _STEPS,
        {
            "task_id": lease.task_id,
            "number": lease.step,
            "response": call.response,
            "input_tokens": call.input_tokens,
            "output_tokens": call.output_tokens,
            "cached_input_tokens": call.cached_input_tokens,
            "cache_write_tokens": call.cache_write_tokens,
            "reasoning_tokens": call.reasoning_tokens,
            "prompt_tokens": call.prompt_tokens,
            "cost_usd": call.cost_usd,
            "model_latency_ms": call.latency_ms,
            "lease_epoch": lease.epoch,
            "started_at": call.started_at,
            "model_completed_at": now,
            "completed_at": now if final else None,
        },
    )


def complete_checkpoint(lease: Lease) -> Change:
    """``lease.step`` is complete (its tools have all run), written with a fenced write. It
    sets the row's last column alone, so PostgreSQL logs little more than that column of the
    row's new version (the rest is the old version's, byte for byte)."""
    return Change(_STEPS, {"number": lease.step}, {"completed_at": utcnow()})


def status(step: Step) -> StepStatus:
    """``completed`` once its tools have all run (a final answer's step at once), else
    ``model_responded``: the completion time says it, so no status is stored."""
    return StepStatus.COMPLETED if step.completed_at is not None else StepStatus.MODEL_RESPONDED
