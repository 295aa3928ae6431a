"""The Celery app's configuration, and enqueueing by task name (the API never imports workers).

A message only says "advance task X at step N"; Postgres holds the truth. The settings follow
"nothing lost, duplicates harmless": acks after the step (late), a message whose worker died
goes back on the queue, one message prefetched at a time, and a hard time limit well inside
the broker's visibility timeout so a redelivery never races a still-running step.
"""

from __future__ import annotations

from functools import lru_cache

from celery import Celery

from shared.constants import ADVANCE_TASK, DELIVER_WEBHOOK_TASK
from shared.settings import Settings, get_settings


def configure(app: Celery, settings: Settings) -> None:
    app.conf.update(
        broker_url=settings.effective_broker_url,
        broker_connection_retry_on_startup=True,
        broker_transport_options=_transport_options(settings),
        task_default_queue=settings.queue_name,
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        task_time_limit=settings.step_time_limit_seconds,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        # SIGTERM: stop taking messages, give running steps this long, then requeue the rest.
        worker_soft_shutdown_timeout=settings.shutdown_grace_seconds,
        worker_enable_soft_shutdown_on_idle=False,
        worker_hijack_root_logger=False,
    )


def _transport_options(settings: Settings) -> dict[str, float]:
    if settings.embedded:
        # The in-memory transport polls; its default (1 s) would add a second to every step.
        return {"polling_interval": 0.01}
    return {"visibility_timeout": settings.visibility_timeout_seconds}


@lru_cache
def get_celery() -> Celery:
    """The process's Celery app (shared by the in-process worker in embedded mode)."""
    app = Celery("ratchet", set_as_current=False)
    configure(app, get_settings())
    return app


def webhook_queue(settings: Settings) -> str:
    """Webhook sends have a queue of their own, listed first so a worker takes them first."""
    return f"{settings.queue_name}.webhooks"


def enqueue_deliveries(delivery_ids: list[str], *, delay_s: float = 0) -> None:
    """Ask a worker to send these webhook deliveries. A lost message only delays them: the
    sweeper re-sends due deliveries."""
    settings = get_settings()
    for delivery_id in delivery_ids:
        get_celery().send_task(
            DELIVER_WEBHOOK_TASK,
            args=[delivery_id],
            queue=webhook_queue(settings),
            countdown=delay_s or None,
        )


def enqueue_step(task_id: str, step: int, *, delay_ms: int = 0) -> None:
    """Ask a worker to advance ``task_id`` at ``step``, now or after ``delay_ms``."""
    countdown = delay_ms / 1000 if delay_ms > 0 else None
    get_celery().send_task(
        ADVANCE_TASK,
        args=[task_id, step],
        queue=get_settings().queue_name,
        countdown=countdown,
    )
