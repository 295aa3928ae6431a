"""The summaries that a task's ``summarize`` context policy committed.

Summary ``n`` stands, in the prompt, for the task's conversation through ``through_step``
(after its first messages), and builds on summary ``n - 1``. Each is written once, in a
fenced write before the model call that uses it, so a crash after its commit reads it back
and never asks for it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from sqlalchemy import Table, select
from sqlalchemy.orm import Session

from shared.store.batch import Add
from shared.store.leases import Lease
from shared.store.tables import Summary, utcnow

_SUMMARIES = cast(Table, Summary.__table__)


@dataclass(frozen=True)
class NewSummary:
    number: int
    through_step: int
    content: str
    model: str
    input_tokens: int
    output_tokens: int
    cost_usd: float


def latest_summary(session: Session, task_id: str) -> Summary | None:
    """The task's newest summary (the one that stands for all the earlier ones), if any."""
    return session.scalar(
        select(Summary).where(Summary.task_id == task_id).order_by(Summary.number.desc()).limit(1)
    )


def list_summaries(session: Session, task_id: str) -> Sequence[Summary]:
    """Every summary of the task, oldest first."""
    query = select(Summary).where(Summary.task_id == task_id).order_by(Summary.number)
    return session.scalars(query).all()


def save_summary(lease: Lease, summary: NewSummary) -> Add:
    """The summary's row, written with a fenced write: only the holder of ``lease`` commits
    it, and its number is unique in the task (a second writer of the same number fails)."""
    return Add(
        _SUMMARIES,
        {
            "task_id": lease.task_id,
            "number": summary.number,
            "through_step": summary.through_step,
            "content": summary.content,
            "model": summary.model,
            "input_tokens": summary.input_tokens,
            "output_tokens": summary.output_tokens,
            "cost_usd": summary.cost_usd,
            "lease_epoch": lease.epoch,
            "created_at": utcnow(),
        },
    )
