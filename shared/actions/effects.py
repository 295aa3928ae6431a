"""What a committed transaction has to tell the world, and the one place that tells it.

An action's changes call for messages — wake the readers of a task, hand its webhooks to a
sender, send a step admitted on the spot, stop a step in flight, wake the dispatcher — that
may go out only once the transaction commits: a reader woken earlier would see the old row,
and a sender handed a delivery a rollback undid would find nothing. So an action returns
them as ``Effects`` and its caller, once committed, passes them to ``after_commit``.

Every message is a hint, never the truth (Postgres is): a lost one costs a delay, not work —
readers poll as a fallback, the dispatcher looks on its own, and the sweeper sends again the
steps and deliveries whose message went missing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shared import notify
from shared.queue import enqueue_deliveries, enqueue_steps
from shared.scheduling.wake import wake

log = logging.getLogger("ratchet.actions")

WebhookSender = Callable[[list[str]], None]


@dataclass(frozen=True)
class Effects:
    """The messages a transaction's changes call for, to be sent once it commits."""

    changed: tuple[str, ...] = ()  # tasks with new events: wake their readers
    deliveries: tuple[str, ...] = ()  # webhook deliveries the outbox holds for sending
    steps: tuple[tuple[str, int], ...] = ()  # (task, step) admitted on the spot: send them
    cancels: tuple[str, ...] = ()  # tasks whose step in flight must stop waiting
    wake: bool = False  # the backlog has new work: wake the dispatcher

    def __add__(self, other: Effects) -> Effects:
        return Effects(
            changed=self.changed + other.changed,
            deliveries=self.deliveries + other.deliveries,
            steps=self.steps + other.steps,
            cancels=self.cancels + other.cancels,
            wake=self.wake or other.wake,
        )


NONE = Effects()


def of_task(task_id: str, deliveries: Iterable[str] = (), *, wake: bool = False) -> Effects:
    """A task's new events (its readers woken), with the webhooks they queued."""
    return Effects(changed=(task_id,), deliveries=tuple(deliveries), wake=wake)


def after_commit(effects: Effects, *, send_webhooks: WebhookSender | None = None) -> None:
    """Send ``effects``, now that their transaction committed. Never raises: each message is
    a hint a lost one only delays (see the module's docstring).

    Webhooks go to the broker's webhook queue, unless ``send_webhooks`` says otherwise: a
    worker process passes its own in-process sender, which sends them from this process."""
    for task_id in effects.cancels:
        notify.publish_cancel(task_id)  # first: the step in flight stops waiting at once
    if effects.changed:
        notify.publish(effects.changed)
    if effects.deliveries:
        _send_webhooks(list(effects.deliveries), send_webhooks or enqueue_deliveries)
    if effects.steps:
        enqueue_steps(list(effects.steps))  # a step whose message is lost: the sweeper's
    if effects.wake:
        wake()


def _send_webhooks(deliveries: list[str], send: WebhookSender) -> None:
    try:
        send(deliveries)
    except Exception:
        # Committed as pending: the sweeper hands them over again after its grace.
        log.exception("webhook deliveries not handed over; the sweeper will send them")
