"""Each webhook endpoint's circuit breaker, kept on its row so the whole fleet shares it.

``closed``: deliveries are sent. After ``RATCHET_WEBHOOK_BREAKER_FAILURES`` failed attempts in
a row (no 2xx: an error answer, a refused connection, a timeout) the circuit is ``open``: until
its cooldown ends no request goes to the endpoint, and a delivery that comes due is put off
(see ``deliveries.defer``) without holding a sender's thread. The first delivery due after the
cooldown is the probe (``half_open``: one request, the others keep waiting); its success
closes the circuit, its failure opens it again for twice as long (at most 64 times the
cooldown). Changing the endpoint's URL or re-enabling it closes it.

Times are the database's clock (``now_ms``), like a delivery's ``next_attempt_ms``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from shared.settings import get_settings
from shared.store.db import now_ms
from shared.store.tables import WebhookEndpoint


class CircuitState(StrEnum):
    """An endpoint's circuit breaker: ``closed`` sends, ``open`` holds deliveries back until
    its cooldown ends, ``half_open`` has one probe out."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


MAX_BACKOFF_DOUBLINGS = 6  # the cooldown grows to at most 64 times the setting


def admit(session: Session, endpoint_id: str, *, probe_ms: int) -> int | None:
    """None if a delivery to the endpoint may be sent now, else until when (ms) to hold it.

    With the cooldown over, one caller wins the probe by a conditional update (``half_open``
    until ``probe_ms`` from now, so a probe whose sender died is taken over after that); every
    other caller is told to wait for the probe's outcome.
    """
    row = session.execute(
        select(WebhookEndpoint.circuit_state, WebhookEndpoint.circuit_until_ms, now_ms()).where(
            WebhookEndpoint.id == endpoint_id
        )
    ).one_or_none()
    if row is None or row[0] == CircuitState.CLOSED:
        return None
    state, until, clock = row[0], row[1], int(row[2])
    if until is not None and until > clock:
        return int(until)
    probe_until = clock + probe_ms
    won = session.execute(
        update(WebhookEndpoint)
        .where(
            WebhookEndpoint.id == endpoint_id,
            WebhookEndpoint.circuit_state == state,
            WebhookEndpoint.circuit_until_ms.is_not_distinct_from(until),
        )
        .values(circuit_state=CircuitState.HALF_OPEN, circuit_until_ms=probe_until)
        .execution_options(synchronize_session=False)
    )
    return None if won.rowcount == 1 else probe_until  # type: ignore[attr-defined]


def record(session: Session, endpoint_id: str, *, succeeded: bool) -> CircuitState:
    """Count an attempt's outcome against the endpoint; returns its circuit's state after it.

    A success closes the circuit and clears the count. A failure adds one; at the threshold,
    or when it was the probe's, the circuit opens for the cooldown, doubled for each failure
    past the threshold (up to ``MAX_BACKOFF_DOUBLINGS`` times).
    """
    if succeeded:
        session.execute(
            update(WebhookEndpoint)
            .where(WebhookEndpoint.id == endpoint_id)
            .values(
                consecutive_failures=0, circuit_state=CircuitState.CLOSED, circuit_until_ms=None
            )
            .execution_options(synchronize_session=False)
        )
        return CircuitState.CLOSED
    row = session.execute(
        update(WebhookEndpoint)
        .where(WebhookEndpoint.id == endpoint_id)
        .values(consecutive_failures=WebhookEndpoint.consecutive_failures + 1)
        .returning(WebhookEndpoint.consecutive_failures, WebhookEndpoint.circuit_state)
        .execution_options(synchronize_session=False)
    ).one_or_none()
    if row is None:
        return CircuitState.CLOSED  # the endpoint was removed meanwhile
    failures, state = int(row[0]), CircuitState(row[1])
    settings = get_settings()
    threshold = settings.webhook_breaker_failures
    if failures < threshold and state != CircuitState.HALF_OPEN:
        return state
    doublings = min(max(failures - threshold, 0), MAX_BACKOFF_DOUBLINGS)
    cooldown_ms = int(settings.webhook_breaker_cooldown_seconds * 1000) << doublings
    session.execute(
        update(WebhookEndpoint)
        .where(WebhookEndpoint.id == endpoint_id)
        .values(circuit_state=CircuitState.OPEN, circuit_until_ms=now_ms() + cooldown_ms)
        .execution_options(synchronize_session=False)
    )
    return CircuitState.OPEN


@dataclass(frozen=True)
class Circuit:
    """An endpoint's circuit as the operator sees it. ``until``: when ``open``, when the probe
    may go; when ``half_open``, when a probe whose sender died is given up on."""

    state: str
    consecutive_failures: int
    until: datetime | None


def circuit_of(endpoint: WebhookEndpoint) -> Circuit:
    until = endpoint.circuit_until_ms
    return Circuit(
        state=endpoint.circuit_state,
        consecutive_failures=endpoint.consecutive_failures,
        until=None if until is None else datetime.fromtimestamp(until / 1000, UTC),
    )


def reset(endpoint: WebhookEndpoint) -> None:
    """Close the endpoint's circuit (its URL changed, or it was re-enabled): a fresh start."""
    endpoint.consecutive_failures = 0
    endpoint.circuit_state = CircuitState.CLOSED
    endpoint.circuit_until_ms = None
