"""What settles a durable wait, exactly once: a completion from outside (an API key, or the
wait's signed URL), its child task's end, its deadline, or its task's cancel.

A wait is settled by a conditional update that only a pending wait matches, so a second
completion finds it settled (``Conflict``) and changes nothing. While its task is
``waiting`` (no worker holds it), the settling also logs ``wait.settled`` on the task and,
when it was the last pending wait, puts the task back in the backlog; while a worker still
holds the task (the step is parking its other calls), only the wait is settled, and the
worker, once parked, settles and resumes what it finds ready (:func:`after_parking`).

Each function is one transaction returning the ``Effects`` to send once it has committed.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.actions.effects import NONE, Effects, of_task
from shared.errors import Conflict, NotFound
from shared.statuses import TERMINAL_STATUSES, TaskStatus
from shared.store import families, tasks
from shared.store import waits as store
from shared.store.tables import Task, ToolCall, Wait
from shared.store.waits import WaitStatus

log = logging.getLogger("ratchet.waits")


def complete(
    session: Session, token: str, payload: Any, *, tenant_id: str | None, by: str
) -> tuple[Wait, Effects]:
    """Complete the wait ``token`` with ``payload`` (the call's result), once. ``tenant_id``:
    the key's tenant (another tenant's wait is NotFound), None for the signed URL. Conflict
    once it was settled, or for a wait on a child (its child's end settles it)."""
    with session.begin():
        wait = store.by_token(session, token)
        if wait is None or (tenant_id is not None and wait.tenant_id != tenant_id):
            raise NotFound(f"no wait {token}")
        task = tasks.lock_task(session, wait.task_id, None)
        wait = store.by_token(session, token)
        assert wait is not None
        if wait.kind != "token":
            raise Conflict(f"wait {token} waits for its child task, which settles it")
        if wait.status != WaitStatus.PENDING:
            raise Conflict(f"wait {token} was already settled: {wait.status}")
        store.settle(session, token, status=WaitStatus.COMPLETED, payload=payload, by=by)
        session.refresh(wait)  # as settled: what its ``wait.settled`` event tells
        deliveries, resumed = _logged(session, task, wait)
    return wait, of_task(task.id, deliveries, wake=resumed) if deliveries else NONE


def open_question(session: Session, thread_id: str) -> str | None:
    """The token of an ``ask_user`` call the thread's turn in flight waits on, if one does."""
    return session.scalar(
        select(Wait.token)
        .join(Task, Task.id == Wait.task_id)
        .join(ToolCall, (ToolCall.task_id == Wait.task_id) & (ToolCall.call_id == Wait.call_id))
        .where(
            Task.thread_id == thread_id,
            Task.status.in_([TaskStatus.WAITING, TaskStatus.RUNNING]),
            Wait.status == WaitStatus.PENDING,
            Wait.kind == "token",
            ToolCall.tool == "ask_user",
        )
        .limit(1)
    )


def settle_child(session: Session, child_id: str) -> Effects:
    """Settle the wait of the call that started ``child_id``, now that the child ended: its
    answer is the call's result, its failure or cancel the call's error; its usage rolls up
    into the parent. Nothing if the child is not over, or its parent is not parked yet (the
    parent settles it once it is)."""
    with session.begin():
        child = session.get(Task, child_id)
        if child is None or child.parent_id is None or child.status not in TERMINAL_STATUSES:
            return NONE
        parent = tasks.lock_task(session, child.parent_id, None)
        if parent.status != TaskStatus.WAITING:
            return NONE
        deliveries, resumed = _settle_children(session, parent, [child])
    return of_task(parent.id, deliveries, wake=resumed) if deliveries else NONE


def after_parking(session: Session, task_id: str) -> Effects:
    """Once a step parked ``task_id``: settle its waits on children that ended meanwhile and,
    if no wait is left pending (all were settled before it parked), put it back to run. A
    settling that happened while the step still held the task left this to it."""
    with session.begin():
        task = tasks.lock_task(session, task_id, None)
        if task.status != TaskStatus.WAITING:
            return NONE
        ended = list(
            session.scalars(
                select(Task)
                .join(Wait, Wait.child_id == Task.id)
                .where(
                    Wait.task_id == task_id,
                    Wait.status == WaitStatus.PENDING,
                    Task.status.in_(list(TERMINAL_STATUSES)),
                )
            )
        )
        deliveries, resumed = _settle_children(session, task, ended)
        if not ended and store.pending_count(session, task_id) == 0:
            tasks.resume_waiting(session, task)  # its waits' events were logged as they settled
            resumed = True
    if resumed and not deliveries:
        return of_task(task_id, wake=True)
    return of_task(task_id, deliveries, wake=resumed) if deliveries else NONE


def expire(session: Session, token: str) -> Effects:
    """Apply a wait's deadline policy, once (nothing if it was settled first): ``fail_call``
    (the call fails: the model reads that the wait timed out), ``tell_model`` (the call's
    result is ``{"timed_out": true}``) or ``fail_task``."""
    with session.begin():
        wait = store.by_token(session, token)
        if wait is None or wait.status != WaitStatus.PENDING:
            return NONE
        task = tasks.lock_task(session, wait.task_id, None)
        why = f"no completion of wait {token} before its deadline"
        if wait.on_timeout == "fail_task" and task.status == TaskStatus.WAITING:
            store.settle(session, token, status=WaitStatus.EXPIRED, error=why, by="timeout")
            error = {"type": "wait_timeout", "message": f"tool call {wait.call_id}: {why}"}
            store.cancel_pending(session, [task.id])
            return of_task(task.id, tasks.fail_awaiting(session, task, error))
        if wait.on_timeout == "tell_model":
            payload = {"timed_out": True, "detail": why}
            store.settle(session, token, status=WaitStatus.EXPIRED, payload=payload, by="timeout")
        else:
            store.settle(session, token, status=WaitStatus.EXPIRED, error=why, by="timeout")
        session.refresh(wait)
        deliveries, resumed = _logged(session, task, wait)
    return of_task(task.id, deliveries, wake=resumed) if deliveries else NONE


def cancel_tree(session: Session, tenant_id: str, task_id: str) -> Effects:
    """Cancel every unfinished task below ``task_id`` (its children, theirs, …), as a
    client's cancel of each would: at once if no worker holds it, else at its step's next
    commit point; and settle the pending waits of those cancelled at once."""
    effects = NONE
    with session.begin():
        below = families.descendants(session, task_id)
        cancelled = []
        for child_id in below:
            try:
                logged = tasks.request_cancel(session, tenant_id, child_id)
            except (Conflict, NotFound):
                continue  # ended already
            effects += of_task(child_id, logged.deliveries)
            if logged.task.cancel_requested_at is not None:
                effects += Effects(cancels=(child_id,))
            else:
                cancelled.append(child_id)
        store.cancel_pending(session, cancelled)
    return effects


def _settle_children(session: Session, parent: Task, ended: list[Task]) -> tuple[list[str], bool]:
    deliveries: list[str] = []
    resumed = False
    for child in ended:
        wait = session.scalar(
            select(Wait).where(Wait.task_id == parent.id, Wait.child_id == child.id)
        )
        if wait is None or wait.status != WaitStatus.PENDING:
            continue
        if child.status == TaskStatus.SUCCEEDED:
            output = (child.result or {}).get("output")
            store.settle(
                session, wait.token, status=WaitStatus.COMPLETED, payload=output, by="child"
            )
        else:
            error = (child.error or {}).get("message") or child.status
            text = f"sub-agent {child.agent} ({child.id}) {child.status}: {error}"
            store.settle(session, wait.token, status=WaitStatus.FAILED, error=text, by="child")
        families.add_children_usage(parent, child)
        session.refresh(wait)
        logged, resumed = _logged(session, parent, wait)
        deliveries += logged
    return deliveries, resumed


def _logged(session: Session, task: Task, wait: Wait) -> tuple[list[str], bool]:
    """Log a settled wait on its task if the task is parked (a worker holding it would log
    over it), and resume the task if it was its last pending wait."""
    if task.status != TaskStatus.WAITING:
        return [], False
    resume = store.pending_count(session, task.id) == 0
    settled = store.public(wait) | {"error": wait.error, "settled_by": wait.settled_by}
    return tasks.record_wait_settled(session, task, settled, resume=resume), resume
