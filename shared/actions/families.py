"""What a sub-agent call does: start its child task, exactly once per call.

A child is keyed by its parent and the parent's call (``uq_tasks_parent_call``), so a crash
between starting it and committing the call's park finds the same child on the re-run,
never a second. It is its parent's tenant's task like any other (admitted fairly, within
every concurrency limit), one level deeper, with a share of what its parent may still spend,
and its parent's deadline.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.actions.effects import Effects, of_task
from shared.agents import versions
from shared.agents.registry import get_agent
from shared.errors import ToolError
from shared.settings import get_settings
from shared.statuses import TERMINAL_STATUSES
from shared.store import families, tasks
from shared.store.tables import Task
from shared.store.tasks import NewTask
from shared.views import TaskState

log = logging.getLogger("ratchet.families")


def start_child(
    session: Session,
    parent: TaskState,
    *,
    call_id: str,
    agent: str,
    task: str,
    siblings: int = 1,
) -> tuple[str, Effects]:
    """The id of the child task ``parent``'s call ``call_id`` started: found if it exists,
    else created now (queued, in the backlog) with ``task`` as its input. ``siblings``: how
    many sub-agent calls share the parent's remaining budget. ToolError (which the parent's
    model reads) past the depth limit, or if the parent is being cancelled."""
    settings = get_settings()
    if parent.depth + 1 > settings.subagent_max_depth:
        raise ToolError(
            f"sub-agent {agent!r} not started: the task is at depth {parent.depth}, and "
            f"sub-agents may go {settings.subagent_max_depth} deep (RATCHET_SUBAGENT_MAX_DEPTH)"
        )
    try:
        with session.begin():
            return _start(
                session, parent, call_id=call_id, agent=agent, task=task, siblings=siblings
            )
    except IntegrityError:  # a concurrent start of the same call committed first
        with session.begin():
            found = families.child_of_call(session, parent.id, call_id)
        if found is None:
            raise
        return found.id, of_task(found.id)


def _start(
    session: Session, parent: TaskState, *, call_id: str, agent: str, task: str, siblings: int
) -> tuple[str, Effects]:
    # Shared with a cancel's update of the parent: a cancel either sees this child among
    # the parent's descendants, or this start sees the cancel and starts nothing.
    row = session.execute(
        select(Task.status, Task.cancel_requested_at)
        .where(Task.id == parent.id)
        .with_for_update(read=True)
    ).one()
    if row.cancel_requested_at is not None or row.status in TERMINAL_STATUSES:
        raise ToolError(f"sub-agent {agent!r} not started: the task is being cancelled")
    found = families.child_of_call(session, parent.id, call_id)
    if found is not None:
        return found.id, of_task(found.id)
    spec = child_spec(parent, call_id=call_id, agent=agent, task=task, siblings=siblings)
    if spec.agent_version is not None:
        versions.record(session, spec.agent_version)
    logged = tasks.create_task(session, parent.tenant_id, spec)
    return logged.task.id, of_task(logged.task.id, logged.deliveries, wake=True)


def child_spec(parent: TaskState, *, call_id: str, agent: str, task: str, siblings: int) -> NewTask:
    """The child's submission: its agent's model (else its parent's), tools, options and
    limits; its parent's tenant, deadline and a share of its remaining budget."""
    settings = get_settings()
    child = get_agent(agent)
    deadline = None
    if parent.deadline_ms is not None:
        deadline = max(0.001, parent.deadline_ms / 1000 - time.time())
    return NewTask(
        agent=child.name,
        model=child.model or parent.model,
        input=task,
        instructions=None,
        tools=list(child.tools),
        model_options=dict(child.model_options or {}),
        max_steps=child.max_steps or settings.default_max_steps,
        budget=budget_share(parent, siblings),
        webhook=None,
        metadata={},
        deadline_seconds=deadline
        if deadline is not None
        else (settings.task_deadline_seconds or None),
        output_schema=child.output_schema,
        context=child.context,
        agent_version=versions.version_of(child).id,
        stream=child.stream,
        priority=0,
        parent_id=parent.id,
        parent_call_id=call_id,
        root_id=parent.root_id or parent.id,
        depth=parent.depth + 1,
    )


def budget_share(parent: TaskState, siblings: int) -> dict[str, Any] | None:
    """An equal share, among the step's ``siblings`` sub-agent calls, of what the parent may
    still spend (its budget less what it and its settled children used); so a tree never
    spends more than its root's budget (give or take each task's last call)."""
    budget = parent.budget or {}
    share: dict[str, Any] = {}
    if budget.get("max_tokens") is not None:
        used = (
            parent.input_tokens
            + parent.output_tokens
            + parent.children_input_tokens
            + parent.children_output_tokens
        )
        share["max_tokens"] = max(1, (int(budget["max_tokens"]) - used) // max(1, siblings))
    if budget.get("max_cost_usd") is not None:
        spent = parent.cost_usd + parent.children_cost_usd
        left = max(0.0, float(budget["max_cost_usd"]) - spent)
        share["max_cost_usd"] = round(left / max(1, siblings), 9) or 1e-9
    return share or None
