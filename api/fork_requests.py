"""Turning a fork request into a task spec: the origin's submission with the fork's changes,
checked as a submission is."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from api import submission
from api.problems import field_name
from api.schemas.forks import OVERRIDES, TaskFork
from api.schemas.tasks import TaskCreate
from shared.actions import forks as fork_actions
from shared.actions.tasks import Submitted
from shared.errors import InvalidRequest
from shared.mcp.names import covers
from shared.settings import get_settings
from shared.store import tasks
from shared.store.db import get_sessionmaker
from shared.store.forks import ForkPoint
from shared.store.tables import Task


def fork(
    tenant_id: str, tenant_name: str, task_id: str, body: TaskFork, idempotency_key: str | None
) -> Submitted:
    """The whole fork, run as one call on the thread pool: the origin read (NotFound for
    another tenant's), its submission with the fork's changes checked as a submission is and
    rate-limited, then created with its inherited steps by the fork action."""
    with get_sessionmaker()() as session, session.begin():
        origin = tasks.get_task(session, tenant_id, task_id)
        inherited, origin_version = submitted_as(origin), origin.agent_version
    spec = submission.resolve(_merged(inherited, body), get_settings(), tenant_id=tenant_id)
    if origin_version is not None and "tools" not in body.model_fields_set:
        # The origin's agent as it ran (its prompt, its tools' schemas), not as this deploy
        # has it: what the kept steps were answered under. New tools take the agent as it is.
        spec = replace(spec, agent_version=origin_version)
    if spec.max_steps <= body.from_step:
        raise InvalidRequest(
            "max_steps",
            f"must be more than from_step ({body.from_step}): the fork's steps after it count "
            f"on from its inherited ones (the origin's max_steps is {spec.max_steps})",
        )
    submission.check_rate(tenant_name)
    point = ForkPoint(
        task_id,
        body.from_step,
        replaced_input=body.input is not None,
        replaced_tool_results=tuple(body.tool_results or ()),
    )
    return fork_actions.fork_task(
        tenant_id,
        tenant_name,
        replace(spec, forked_from=point),
        tool_results=body.tool_results,
        idempotency_key=idempotency_key,
        request_hash=request_hash(task_id, body),
    )


def submitted_as(task: Task) -> dict[str, Any]:
    """The origin as a submission body, with what its submission resolved (its model, tools,
    limits and policies), so a fork changes only what it names. The fork runs the origin's
    agent, at the origin's version unless it changes ``tools`` (see :func:`fork`)."""
    return {
        "agent": task.agent,
        "input": task.input,
        "model": task.model,
        "model_options": task.model_options,
        "instructions": task.instructions,
        "tools": task.tools,
        "max_steps": task.max_steps,
        "budget": task.budget,
        "webhook": task.webhook,
        "metadata": task.meta,
        "approval": task.approval,
        "priority": task.priority,
        "output_schema": task.output_schema,
        "context": task.context,
        "stream": task.stream,
    }


def _merged(inherited: dict[str, Any], body: TaskFork) -> TaskCreate:
    """The origin's submission with each field the fork gives in its place."""
    given = body.model_dump(mode="json", include=set(OVERRIDES & body.model_fields_set))
    if given.get("input") is None:
        given.pop("input", None)  # null keeps the origin's input: a task has one
    merged = inherited | given
    approval, tools = merged.get("approval"), merged.get("tools")
    if approval and "tools" in given and tools is not None:
        # A tool the fork dropped cannot be called, so it has no calls to approve.
        kept = [name for name in approval.get("tools", []) if covers(tools, name)]
        merged["approval"] = approval | {"tools": kept}
    try:
        return TaskCreate.model_validate(merged)
    except ValidationError as exc:  # the origin's own values, no longer valid here
        first = exc.errors(include_url=False)[0]
        where, _ = field_name(list(first["loc"]))
        raise InvalidRequest(where, f"the origin's value: {first['msg']}") from exc


def request_hash(task_id: str, body: TaskFork) -> str:
    """What an Idempotency-Key stands for: this fork of this task."""
    document = {"fork_of": task_id, **body.model_dump(mode="json", exclude_unset=True)}
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
