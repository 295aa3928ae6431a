"""Forks: a task whose history is another task's committed steps, reused and never redone.

A fork from step ``n`` holds copies of the origin's rows of steps 1..n: each step's model
response (its checkpoint) and each tool call's settled outcome (its ledger row). Its next
lease reads them back as any task reads its own committed steps, so none of those model
calls is asked again and none of those tools runs again; the fork goes on at step ``n + 1``.
Copying a bounded set of rows once keeps the fork's history its own: the origin may go on
running, be retried or be deleted without changing it. With the same settings, the fork's
first prompt is the one the origin sent at that step (the summaries of its context policy
included, as they stood then).

Only committed steps are read: a step counts once it is complete (all its tool calls
settled), so a fork point is never a step whose outcome is still open.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import ColumnElement, Table, func, insert, literal, select, update
from sqlalchemy.orm import Session

from shared.errors import InvalidRequest
from shared.store.ledger import CallStatus
from shared.store.tables import Step, Summary, ToolCall, utcnow

_STEPS = cast(Table, Step.__table__)
_CALLS = cast(Table, ToolCall.__table__)
_SUMMARIES = cast(Table, Summary.__table__)


@dataclass(frozen=True)
class ForkPoint:
    """Where a fork starts: after step ``step`` of task ``task_id`` (0: before any step)."""

    task_id: str
    step: int
    replaced_input: bool = False
    replaced_tool_results: tuple[str, ...] = ()  # provider call ids of step ``step``

    def as_json(self) -> dict[str, Any]:
        """As ``tasks.forked_from`` stores it (and the Task document shows it)."""
        return {
            "task_id": self.task_id,
            "step": self.step,
            "replaced_input": self.replaced_input,
            "replaced_tool_results": list(self.replaced_tool_results),
        }


def committed_steps(session: Session, task_id: str) -> int:
    """How many of the task's steps are committed: complete, their tool calls all settled.
    Steps complete in order, so they are steps 1..that number."""
    count = session.scalar(
        select(func.count())
        .select_from(Step)
        .where(Step.task_id == task_id, Step.completed_at.is_not(None))
    )
    return int(count or 0)


def check_fork_point(
    session: Session, task_id: str, step: int, *, tool_results: Mapping[str, Any]
) -> None:
    """Raise InvalidRequest unless a fork may start after ``step`` of the task: a committed
    step (or 0), and each replaced result one of that step's tool calls."""
    committed = committed_steps(session, task_id)
    if step > committed:
        raise InvalidRequest(
            "from_step",
            f"task {task_id} has {committed} committed step(s): a fork starts after one of "
            f"them (0..{committed})",
        )
    if not tool_results:
        return
    if step == 0:
        raise InvalidRequest("tool_results", "from_step 0 has no tool calls to replace")
    ids = set(
        session.scalars(
            select(ToolCall.provider_call_id).where(
                ToolCall.task_id == task_id, ToolCall.step_number == step
            )
        )
    )
    for provider_call_id in tool_results:
        if provider_call_id not in ids:
            raise InvalidRequest(
                f"tool_results.{provider_call_id}",
                f"not a tool call of step {step} (its calls: {', '.join(sorted(ids)) or 'none'})",
            )


def copy_history(
    session: Session,
    *,
    source: str,
    target: str,
    through_step: int,
    tool_results: Mapping[str, Any] | None = None,
) -> None:
    """Copy ``source``'s steps 1..``through_step`` (checkpoints, settled ledger rows, and the
    summaries that stand for them) to ``target``, a task created in this transaction; the
    caller checked the fork point (:func:`check_fork_point`) and owns the transaction.

    A copied call keeps its outcome and names the task that ran it (``inherited_from``): it
    ran with that task's idempotency key and is never run again. ``tool_results`` replaces
    the outcome of calls of step ``through_step`` (by provider call id) with a success
    holding the given value: the model reads that instead.
    """
    if through_step <= 0:
        return
    _copy(session, _STEPS, Step.task_id == source, Step.number <= through_step, target=target)
    _copy(
        session,
        _CALLS,
        ToolCall.task_id == source,
        ToolCall.step_number <= through_step,
        target=target,
        inherited_from=func.coalesce(ToolCall.inherited_from, source),
    )
    for provider_call_id, value in (tool_results or {}).items():
        session.execute(
            update(ToolCall)
            .where(
                ToolCall.task_id == target,
                ToolCall.step_number == through_step,
                ToolCall.provider_call_id == provider_call_id,
            )
            .values(status=CallStatus.SUCCEEDED, result=value, error=None, finished_at=utcnow())
            .execution_options(synchronize_session=False)
        )
    _copy(
        session,
        _SUMMARIES,
        Summary.task_id == source,
        _in_effect(source, through_step, replaced=bool(tool_results)),
        target=target,
    )


def _in_effect(source: str, through_step: int, *, replaced: bool) -> ColumnElement[bool]:
    """The summaries the origin's prompt of the step after the fork point stood on: those of
    steps up to the fork point, written before that step's model call (a summary written
    later, for a later prompt, would make the fork's prompt one the origin never sent). A
    replaced step's summary is left out: it stands for the outcome the step no longer has."""
    last = through_step - 1 if replaced else through_step
    next_call = (
        select(Step.started_at)
        .where(Step.task_id == source, Step.number == through_step + 1)
        .scalar_subquery()
    )
    return (Summary.through_step <= last) & (
        next_call.is_(None) | (Summary.created_at <= next_call)
    )


def _copy(
    session: Session,
    table: Table,
    *where: ColumnElement[bool],
    target: str,
    **replace: Any,
) -> None:
    """INSERT … SELECT: ``table``'s rows matching ``where``, as rows of ``target``, with
    ``replace``'s columns computed anew (a lease epoch of the fork's own: none yet)."""
    values: dict[str, Any] = {"task_id": literal(target)}
    if "lease_epoch" in table.c:
        values["lease_epoch"] = literal(0)
    values |= replace
    names = [column.name for column in table.c]
    chosen: Sequence[Any] = [values.get(name, table.c[name]) for name in names]
    session.execute(insert(table).from_select(names, select(*chosen).where(*where)))
