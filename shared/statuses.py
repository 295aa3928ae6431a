"""The statuses clients and the store share: a task's status and a person's decision on a
waiting call. Light on purpose (the Python client imports it): the same strings in the
database, the API, the events and the CLI."""

from __future__ import annotations

from enum import StrEnum


class TaskStatus(StrEnum):
    """A task's status: the same strings in the database, the API, the events and the CLI."""

    QUEUED = "queued"
    RUNNING = "running"
    AWAITING_APPROVAL = "awaiting_approval"
    # Parked on its children or on the outside world (a durable wait): no lease, no slot.
    WAITING = "waiting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


# A terminal task never changes again; a runnable one has a step to run (or running).
TERMINAL_STATUSES = frozenset({TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED})
RUNNABLE_STATUSES = frozenset({TaskStatus.QUEUED, TaskStatus.RUNNING})


def in_order(statuses: frozenset[TaskStatus]) -> list[TaskStatus]:
    """The statuses in the enum's order: a set's order changes from one process to the next,
    and SQL text, pages and answers built from it should not."""
    return [status for status in TaskStatus if status in statuses]


class Decision(StrEnum):
    """What a person (or the deadline's policy) decided about a waiting call."""

    APPROVE = "approve"
    EDIT = "edit"  # run it with the person's arguments instead of the model's
    REJECT = "reject"
