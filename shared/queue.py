"""The Celery app's configuration, and enqueueing by task name (the API never imports workers).

A message only says "advance task X at step N"; Postgres holds the truth. The settings follow
"nothing lost, duplicates harmless": acks after the step (late), a message whose worker died
goes back on the queue, one message prefetched at a time, and a hard time limit well inside
the broker's visibility timeout so a redelivery never races a still-running step.
"""

from __future__ import annotations

import json
import logging
import time
from functools import lru_cache
from typing import Any

from celery import Celery

from shared.constants import ADVANCE_TASK, ADVANCE_TASKS, DELIVER_WEBHOOK_TASK
from shared.settings import Settings, get_settings
from shared.transport import get_transport, transport_for

log = logging.getLogger("ratchet.queue")
# Each message carries when it was sent (ms, the sender's clock), so the sweeper can tell a
# message stuck behind a backlog from a lost one (see oldest_waiting_ms).
SENT_AT_HEADER = "ratchet_sent_ms"


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def redis_broker_url(settings: Settings | None = None) -> str | None:
    """The broker's URL when the broker is Redis (which can be looked into: its queues are
    lists, and other keys may sit beside them), else None."""
    url = (settings or get_settings()).effective_broker_url
    return url if url.startswith(REDIS_SCHEMES) else None


def configure(app: Celery, settings: Settings) -> None:
    app.conf.update(
        broker_url=settings.effective_broker_url,
        broker_connection_retry_on_startup=True,
        broker_transport_options=transport_for(settings).broker_options(settings),
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


@lru_cache
def get_celery() -> Celery:
    """The process's Celery app (shared by the in-process worker under ``ratchet dev``)."""
    app = Celery("ratchet", set_as_current=False)
    configure(app, get_settings())
    return app


def webhook_queue(settings: Settings) -> str:
    """Webhook sends have a queue of their own, listed first so a worker takes them first."""
    return webhook_queue_of(settings.queue_name)


def webhook_queue_of(queue_name: str) -> str:
    """The webhook queue that goes with the steps queue ``queue_name``."""
    return f"{queue_name}.webhooks"


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
            headers=_sent_now(),
        )


def enqueue_step(task_id: str, step: int, *, delay_ms: int = 0, producer: Any = None) -> None:
    """Ask a worker to advance ``task_id`` at ``step``, now or after ``delay_ms``."""
    countdown = delay_ms / 1000 if delay_ms > 0 else None
    _send_steps(ADVANCE_TASK, [task_id, step], producer=producer, countdown=countdown)


def _send_steps(name: str, args: list[Any], *, producer: Any, countdown: float | None) -> None:
    get_celery().send_task(
        name,
        args=args,
        queue=get_settings().queue_name,
        countdown=countdown,
        headers=_sent_now(),
        producer=producer,
        argsrepr=repr(args),  # as Celery's own would read; its generic one costs
        kwargsrepr="{}",
    )


# The most (task, step) pairs one message carries. A worker process takes one message at a
# time, and under load the taking costs more than the hand-off of a step to a thread: an
# admission round's tasks go several to a message, and its messages to as many processes.
STEPS_PER_MESSAGE = 8


def enqueue_steps(steps: list[tuple[str, int]]) -> bool:
    """Send messages for these (task, step) pairs, several to a message (in at least four
    messages, while there are as many pairs, so that they spread over the processes), all
    in one Redis pipeline (kombu's publish batch); whether they went. Never raises: a step
    whose message was lost is the sweeper's to send."""
    if not steps:
        return True
    size = max(1, min(STEPS_PER_MESSAGE, len(steps) // 4))
    try:
        with get_celery().producer_or_acquire() as producer, producer.batch():
            for start in range(0, len(steps), size):
                chunk = steps[start : start + size]
                if len(chunk) == 1:
                    enqueue_step(*chunk[0], producer=producer)
                    continue
                pairs = [[task_id, step] for task_id, step in chunk]
                _send_steps(ADVANCE_TASKS, [pairs], producer=producer, countdown=None)
    except Exception:
        log.exception("could not send %d steps' messages; the sweeper will", len(steps))
        return False
    return True


def _sent_now() -> dict[str, Any]:
    return {SENT_AT_HEADER: int(time.time() * 1000)}


def oldest_waiting_ms(queue: str) -> int | None:
    """When the oldest message still waiting in ``queue`` was sent (the sender's clock); None
    when none waits or the broker cannot be looked into (only Redis can: the list's tail is
    its next message).

    Messages are taken in the order they were sent, so a task whose message went out after
    that one is behind a backlog, not lost, and the sweeper leaves it alone. Without this,
    each sweep would send one more message for every task waiting longer than the grace, and
    a backlog would feed itself. Anything unexpected turns the check off (None): then the
    sweeper goes by the clock alone, as it would with another broker.
    """
    try:
        raw = get_transport().oldest_message(queue)
    except Exception as exc:  # never let a look into the queue stop the sweeping
        log.warning("could not look into queue %s: %s", queue, exc)
        return None
    if raw is None:
        return None
    try:
        sent = json.loads(raw)["headers"][SENT_AT_HEADER]
    except (ValueError, KeyError, TypeError):
        return None  # a message from before this header, or not one of ours
    if not isinstance(sent, int):
        return None
    if time.time() * 1000 - sent > get_settings().visibility_timeout_seconds * 1000:
        return None  # waiting longer than any backlog should: a queue nobody takes from
    return sent
