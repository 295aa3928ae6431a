"""Every status vocabulary is one StrEnum whose strings are the ones the database rows, the
API and the events already hold: renaming a member never changes what is stored or sent."""

from __future__ import annotations

from enum import StrEnum

import pytest

from shared.statuses import RUNNABLE_STATUSES, TERMINAL_STATUSES, Decision, TaskStatus, in_order
from shared.store.checkpoints import StepStatus
from shared.store.ledger import CallStatus
from shared.store.outbox import DeliveryStatus
from shared.store.waits import WaitStatus
from shared.webhooks.circuits import CircuitState

VOCABULARIES: list[tuple[type[StrEnum], list[str]]] = [
    (
        TaskStatus,
        ["queued", "running", "awaiting_approval", "waiting", "succeeded", "failed", "cancelled"],
    ),
    (CallStatus, ["started", "awaiting", "waiting", "succeeded", "failed"]),
    (WaitStatus, ["pending", "completed", "failed", "expired", "cancelled"]),
    (DeliveryStatus, ["pending", "sending", "delivered", "failed", "disabled"]),
    (CircuitState, ["closed", "open", "half_open"]),
    (Decision, ["approve", "edit", "reject"]),
    (StepStatus, ["model_responded", "completed"]),
]


@pytest.mark.parametrize(("vocabulary", "strings"), VOCABULARIES, ids=str)
def test_a_vocabulary_keeps_its_strings(vocabulary: type[StrEnum], strings: list[str]) -> None:
    assert [member.value for member in vocabulary] == strings
    assert all(vocabulary(value) == value for value in strings)


def test_sets_of_task_statuses_hold_members_in_the_enums_order() -> None:
    assert in_order(TERMINAL_STATUSES) == ["succeeded", "failed", "cancelled"]
    assert in_order(RUNNABLE_STATUSES) == ["queued", "running"]
    assert "failed" in TERMINAL_STATUSES  # a row's plain string finds its member
