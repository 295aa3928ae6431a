"""Webhook deliveries (the attempt log, redelivery) and the tenant's signing secret."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from fastapi import APIRouter

from api import params
from api.deps import Admin, Reader, SessionDep, Writer
from api.params import PageCursor, PageLimit, cursor_after
from api.problems import responses
from api.schemas.webhooks import AttemptOut, DeliveryList, DeliveryOut, SecretOut
from shared.actions import webhooks as webhook_actions
from shared.actions.effects import after_commit
from shared.settings import get_settings
from shared.store import tasks
from shared.views import aware
from shared.webhooks import deliveries as webhook_deliveries
from shared.webhooks import secrets as webhook_secrets

router = APIRouter(tags=["webhooks"])


def _out(delivery: Any, attempts: list[Any]) -> DeliveryOut:
    return DeliveryOut(
        id=delivery.id,
        webhook_id=f"msg_{delivery.id}",
        event_type=delivery.event_type,
        event_seq=delivery.event_seq,
        url=delivery.url,
        status=delivery.status,
        attempts=[
            AttemptOut(
                number=a.number,
                started_at=aware(a.started_at),
                status_code=a.status_code,
                latency_ms=a.latency_ms,
                error=a.error,
            )
            for a in attempts
        ],
        last_error=delivery.last_error,
        next_attempt_at_ms=delivery.next_attempt_ms,
        created_at=aware(delivery.created_at),
        delivered_at=aware(delivery.delivered_at),
    )


@router.get(
    "/v1/tasks/{task_id}/webhook-deliveries",
    response_model=DeliveryList,
    summary="A task's webhook deliveries",
    responses=responses({404: "no such task (another tenant's task is not found either)"}),
)
def list_deliveries(
    task_id: str,
    principal: Reader,
    session: SessionDep,
    limit: PageLimit = 50,
    cursor: PageCursor = None,
) -> DeliveryList:
    """Every webhook delivery of the task, each with its attempts (status, latency, error)."""
    after = cursor_after(cursor)
    with session.begin():
        tasks.get_task(session, principal.tenant_id, task_id)
        rows, attempts, last = webhook_deliveries.list_for_task(
            session, task_id, after=after, limit=limit
        )
        items = [_out(r, attempts[r.id]) for r in rows]
    return DeliveryList(items=items, next_cursor=params.next_cursor(last))


@router.post(
    "/v1/webhook-deliveries/{delivery_id}/redeliver",
    status_code=202,
    response_model=DeliveryOut,
    summary="Send a webhook delivery again",
    responses=responses({404: "no such delivery (another tenant's is not found either)"}),
)
def redeliver(delivery_id: str, principal: Writer, session: SessionDep) -> DeliveryOut:
    """Send the delivery again now, with a fresh retry schedule; answers with the delivery as
    it is (its attempts so far)."""
    redelivered = webhook_actions.redeliver(session, principal.tenant_id, delivery_id)
    out = _out(redelivered.delivery, redelivered.attempts)
    after_commit(redelivered.effects)
    return out


@router.post(
    "/v1/webhook-secret/rotate", response_model=SecretOut, summary="Rotate the signing secret"
)
def rotate_secret(principal: Admin, session: SessionDep) -> SecretOut:
    """A new signing secret, shown once. The old one keeps signing for the overlap period."""
    overlap = timedelta(hours=get_settings().webhook_secret_overlap_hours)
    with session.begin():
        secret = webhook_secrets.rotate(session, principal.tenant_id, overlap=overlap)
    now = datetime.now().astimezone()
    return SecretOut(secret=secret, previous_valid_until=now + overlap)
