"""The Celery app and its tasks. Start it with ``ratchet worker``."""

from __future__ import annotations

import gc
import logging
from functools import partial
from typing import Any

from celery import signals

from shared.agents.registry import get_registry
from shared.constants import ADVANCE_TASK, ADVANCE_TASKS, DELIVER_WEBHOOK_TASK
from shared.observability import logs, tracing
from shared.queue import enqueue_steps, get_celery
from shared.sandbox import host as sandbox
from shared.settings import get_settings
from shared.store.db import reset_engines
from shared.webhooks import egress
from workers import (
    cancels,
    dispatcher,
    presence,
    providers,
    recycling,
    step_pool,
    sweeper,
    tokens,
    webhook_sender,
)
from workers.steps import runner

log = logging.getLogger("ratchet.worker")
app = get_celery()


@app.task(name=ADVANCE_TASK)
def advance_task(task_id: str, step: int | None = None) -> None:
    """Hand the step to this process's step pool (waiting for a free thread); it runs there,
    with the task's next steps after it, so the message is done once the step has started.
    Safe to run twice (the lease decides). A process that is leaving keeps the message until
    it exits, and it goes back on the queue."""
    if recycling.leaving():
        recycling.hold()
    work = partial(runner.advance, task_id, step, go_on=step_pool.accepting)
    step_pool.get_pool().run(work)


@app.task(name=ADVANCE_TASKS)
def advance_tasks(steps: list[list[Any]]) -> None:
    """Hand each (task, step) of an admission round's message to the step pool, in order,
    as :func:`advance_task` does one. The first waits for a free thread, as a message of
    one would; the others only take free ones, and those left over when the pool is full go
    back on the queue for another process, rather than wait here for steps to end. A
    process that dies before it is done never acknowledges the message, and it comes back:
    a step already running then finds its lease held and leaves it. (A process that is
    leaving does the same on purpose.)"""
    if recycling.leaving():
        recycling.hold()
    pool = step_pool.get_pool()
    for index, (task_id, step) in enumerate(steps):
        work = partial(runner.advance, str(task_id), int(step), go_on=step_pool.accepting)
        if not pool.run(work, wait=index == 0):
            enqueue_steps([(str(t), int(s)) for t, s in steps[index:]])
            return


@app.task(name=DELIVER_WEBHOOK_TASK)
def deliver_webhook(delivery_id: str) -> None:
    """Send one webhook delivery from the outbox; safe to run twice (the claim decides)."""
    webhook_sender.deliver(delivery_id)


@signals.setup_logging.connect
def _logging(loglevel: str | int | None = None, **_: Any) -> None:
    # Connected, this replaces Celery's own logging set-up: one format for every process.
    logs.configure_from_settings(loglevel)


@signals.worker_process_init.connect
def _fresh_connections(**_: Any) -> None:
    # A forked child must not reuse the parent's database sockets.
    reset_engines()
    step_pool.get_pool()  # its threads start now, not on the first messages
    cancels.warm()
    cancels.on_wedged(recycling.recycle)  # too many calls it cannot stop: it is replaced
    presence.start()  # a pool process (prefork's child, solo's main) runs steps: it says so


@signals.worker_process_shutdown.connect
def _drain_steps(**_: Any) -> None:
    # A pool process that is told to stop lets its steps in flight commit first.
    step_pool.drain(get_settings().shutdown_grace_seconds)
    presence.stop()


@signals.worker_init.connect
def _name_worker(sender: Any, **_: Any) -> None:
    presence.configure(sender)  # before the fork: the pool's processes take its name


@signals.worker_init.connect
def _load_registry(**_: Any) -> None:
    egress.warn_if_open(get_settings())
    get_registry()
    sandbox.check(quiet=True)  # once, before the fork; said when the worker is ready
    tokens.bundled()  # before the fork: the processes share it, and no step waits for it
    providers.preload()  # likewise the SDKs of the providers set up
    tracing.configure("ratchet-worker")
    # Everything loaded so far lives as long as the process: the collector stops walking it
    # (the SDKs' thousands of classes made each full collection cost a step's CPU), and the
    # forked processes stop copying the pages that walking would touch.
    gc.freeze()


@signals.worker_ready.connect
def _start_sweeper(**_: Any) -> None:
    sandbox.announce()  # one line: whether run_python can run here, and why not
    sweeper.start()
    dispatcher.start()
    if not presence.forks():  # the steps run in this process (a threads pool)
        presence.start()


@signals.worker_shutdown.connect
def _leave_fleet(**_: Any) -> None:
    presence.stop()  # a no-op where it never started (prefork's main process)
