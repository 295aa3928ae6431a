"""How long a webhook delivery waits before trying again: as ``RATCHET_WEBHOOK_RETRY_SCHEDULE``
says, ±20%, failing once the schedule is spent."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.settings import get_settings
from shared.store.tables import WebhookDelivery
from shared.webhooks.deliveries import next_delay_seconds
from tests.conftest import Configure

SCHEDULE = [0.0, 5.0, 300.0, 1800.0]


@pytest.fixture
def default_schedule(configure: Configure) -> None:
    configure(RATCHET_WEBHOOK_RETRY_SCHEDULE=None)


def delivery(*, attempts: int, attempts_base: int = 0) -> Any:
    return WebhookDelivery(attempts=attempts, attempts_base=attempts_base)


@given(
    schedule=st.lists(st.floats(0, 10**6), min_size=1, max_size=10),
    attempts=st.integers(1, 12),
)
def test_after_the_ith_attempt_a_delivery_waits_the_ith_entry_give_or_take_a_fifth(
    schedule: list[float], attempts: int
) -> None:
    delay = next_delay_seconds(delivery(attempts=attempts), schedule)
    if attempts >= len(schedule):
        assert delay is None  # spent: the delivery fails
    else:
        assert delay is not None
        assert 0.8 * schedule[attempts] <= delay <= 1.2 * schedule[attempts]


@pytest.mark.usefixtures("default_schedule")
def test_the_default_schedule_retries_after_5_s_then_5_min_and_gives_up_when_spent() -> None:
    schedule = get_settings().webhook_retry_schedule
    second = next_delay_seconds(delivery(attempts=1), schedule)
    third = next_delay_seconds(delivery(attempts=2), schedule)
    assert second is not None
    assert third is not None
    assert 4.0 <= second <= 6.0
    assert 240.0 <= third <= 360.0
    assert next_delay_seconds(delivery(attempts=len(schedule)), schedule) is None


def test_a_redelivery_starts_the_schedule_over() -> None:
    spent = delivery(attempts=len(SCHEDULE))
    assert next_delay_seconds(spent, SCHEDULE) is None
    redelivered = delivery(attempts=len(SCHEDULE) + 1, attempts_base=len(SCHEDULE))
    delay = next_delay_seconds(redelivered, SCHEDULE)
    assert delay is not None
    assert 4.0 <= delay <= 6.0
