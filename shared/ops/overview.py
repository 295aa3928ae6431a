"""The overview's aggregates: what the fleet (or one tenant) did in the last hour or day.

Nothing here scans the tasks or events table. Counts of tasks waiting or running come from
``ix_tasks_status_due``; everything about finished or submitted tasks reads only the rows of
its time window, through ``ix_tasks_finished_at`` and ``ix_tasks_created_at``; percentiles
are taken over the window's newest :data:`SAMPLE` tasks. ``tenant_id=None`` is the whole
fleet (the operator's view)."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from shared.ops import search
from shared.statuses import TERMINAL_STATUSES, TaskStatus, in_order
from shared.store.backends import backend_of, plan_with_values
from shared.store.outbox import DeliveryStatus
from shared.store.tables import Step, Task, WebhookDelivery, utcnow
from shared.views import aware

ACTIVE = (TaskStatus.QUEUED, TaskStatus.RUNNING, TaskStatus.AWAITING_APPROVAL)
WINDOWS = {"1h": (timedelta(hours=1), 60), "24h": (timedelta(hours=24), 3600)}
SAMPLE = 2000  # tasks whose durations make the percentiles
STEP_SAMPLE = 300  # tasks whose steps make the step-latency percentiles
GROUPS = ("model", "agent", "tenant")


def _scoped(query: Select[Any], tenant_id: str | None) -> Select[Any]:
    return query if tenant_id is None else query.where(Task.tenant_id == tenant_id)


def active(session: Session, tenant_id: str | None) -> dict[str, int]:
    """Tasks waiting or running now, by state (from the status index)."""
    query = select(Task.status, func.count()).where(Task.status.in_(ACTIVE))
    grouped = _scoped(query, tenant_id).group_by(Task.status)
    return dict(session.execute(grouped).tuples().all())


@dataclass
class Totals:
    tasks: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0

    def add(self, row: Any) -> None:
        self.tasks += row.n
        self.input_tokens += int(row.input_tokens or 0)
        self.output_tokens += int(row.output_tokens or 0)
        self.cost_usd += float(row.cost_usd or 0)


def finished(session: Session, tenant_id: str | None, *, since: datetime) -> list[Any]:
    """The window's finished tasks counted and summed by everything the overview breaks them
    down by, in one pass over the window's rows (a few thousand groups at most)."""
    kind = Task.error["type"].as_string().label("kind")
    keys = (Task.status, Task.model, Task.agent, Task.tenant_id, kind)
    query = select(
        *keys,
        func.count().label("n"),
        func.sum(Task.input_tokens).label("input_tokens"),
        func.sum(Task.output_tokens).label("output_tokens"),
        func.sum(Task.cost_usd).label("cost_usd"),
    ).where(Task.finished_at >= since)
    return list(session.execute(_scoped(query, tenant_id).group_by(*keys)).all())


def usage_of(rows: Sequence[Any], names: dict[str, str], *, by: str) -> list[dict[str, Any]]:
    """Tasks, tokens and cost by model, agent or tenant, the costliest first (top 20)."""
    totals: dict[str, Totals] = defaultdict(Totals)
    for row in rows:
        key = names.get(row.tenant_id, row.tenant_id) if by == "tenant" else getattr(row, by)
        totals[key].add(row)
    ranked = sorted(totals.items(), key=lambda item: (-item[1].cost_usd, -item[1].tasks))
    return [{by: key, **asdict(t) | {"cost_usd": round(t.cost_usd, 6)}} for key, t in ranked[:20]]


def errors_of(rows: Sequence[Any]) -> list[dict[str, Any]]:
    """The failed tasks' error types, the commonest first (top 20)."""
    counts: Counter[str] = Counter()
    for row in rows:
        if row.status == TaskStatus.FAILED:
            counts[row.kind or "unknown"] += row.n
    return [{"type": kind, "count": n} for kind, n in counts.most_common(20)]


def usage(
    session: Session, tenant_id: str | None, *, since: datetime, by: str
) -> list[dict[str, Any]]:
    """Tasks, tokens and cost of the tasks finished since ``since``, by model, agent or
    tenant, the costliest first."""
    rows = finished(session, tenant_id, since=since)
    return usage_of(rows, search.tenant_names(session, [r.tenant_id for r in rows]), by=by)


def series(
    session: Session, tenant_id: str | None, *, since: datetime, bucket_seconds: int
) -> list[dict[str, Any]]:
    """Per bucket from ``since`` to now: tasks submitted, and finished by state."""
    epoch = backend_of(session).epoch_seconds
    start = math.floor(since.timestamp() / bucket_seconds)
    end = math.floor(utcnow().timestamp() / bucket_seconds)
    rows = {
        n: {"start": datetime.fromtimestamp(n * bucket_seconds, since.tzinfo), "submitted": 0}
        | dict.fromkeys(in_order(TERMINAL_STATUSES), 0)
        for n in range(start, end + 1)
    }
    created = func.floor(epoch(Task.created_at) / bucket_seconds).label("bucket")
    submitted = select(created, func.count()).where(Task.created_at >= since)
    for bucket, n in session.execute(_scoped(submitted, tenant_id).group_by(created)).tuples():
        rows.get(int(bucket), {})["submitted"] = n
    ended = func.floor(epoch(Task.finished_at) / bucket_seconds).label("bucket")
    finished = select(ended, Task.status, func.count()).where(Task.finished_at >= since)
    grouped = _scoped(finished, tenant_id).group_by(ended, Task.status)
    for bucket, status, n in session.execute(grouped).tuples():
        rows.get(int(bucket), {})[status] = n
    return list(rows.values())


def percentiles(values: Sequence[float]) -> dict[str, float | int | None]:
    """p50, p95 and p99 (nearest rank) of ``values``, and how many there were."""
    ordered = sorted(values)

    def rank(p: float) -> float | None:
        return ordered[max(0, math.ceil(p * len(ordered)) - 1)] if ordered else None

    return {"p50": rank(0.50), "p95": rank(0.95), "p99": rank(0.99), "count": len(ordered)}


def latencies(session: Session, tenant_id: str | None, *, since: datetime) -> dict[str, Any]:
    """Task duration (start to finish) over the window's newest :data:`SAMPLE` finished
    tasks, and model-call latency over the steps of the newest :data:`STEP_SAMPLE`."""
    query = (
        select(Task.id, Task.started_at, Task.finished_at)
        .where(Task.finished_at >= since, Task.started_at.is_not(None))
        .order_by(Task.finished_at.desc())
        .limit(SAMPLE)
    )
    rows = session.execute(_scoped(query, tenant_id)).all()
    durations = [
        (finished - started).total_seconds() * 1000
        for _, s, f in rows
        if (started := aware(s)) and (finished := aware(f))
    ]
    ids = [task_id for task_id, _, _ in rows[:STEP_SAMPLE]]
    steps = session.scalars(select(Step.model_latency_ms).where(Step.task_id.in_(ids))).all()
    return {
        "task_duration_ms": percentiles(durations),
        "model_latency_ms": percentiles([float(ms) for ms in steps if ms]),
    }


def webhook_failures(session: Session, tenant_id: str | None, *, since: datetime) -> int:
    """Webhook deliveries created since ``since`` that failed for good or were dropped
    because their endpoint was disabled."""
    query = select(func.count()).where(
        WebhookDelivery.status.in_((DeliveryStatus.FAILED, DeliveryStatus.DISABLED)),
        WebhookDelivery.created_at >= since,
    )
    if tenant_id is not None:
        query = query.where(WebhookDelivery.tenant_id == tenant_id)
    return int(session.scalar(query) or 0)


def overview(session: Session, tenant_id: str | None, *, window: str = "24h") -> dict[str, Any]:
    """Everything the overview page shows about tasks, for the last hour or day."""
    plan_with_values(session)
    span, bucket = WINDOWS[window]
    since = utcnow() - span
    rows = finished(session, tenant_id, since=since)
    names = search.tenant_names(session, [r.tenant_id for r in rows])
    states = dict.fromkeys(TaskStatus, 0) | active(session, tenant_id)
    for row in rows:
        states[row.status] += row.n
    return {
        "window": window,
        "since": since,
        "states": states,
        "series": series(session, tenant_id, since=since, bucket_seconds=bucket),
        "latency": latencies(session, tenant_id, since=since),
        "usage": {by: usage_of(rows, names, by=by) for by in GROUPS},
        "errors": errors_of(rows),
        "webhook_failures": webhook_failures(session, tenant_id, since=since),
    }
