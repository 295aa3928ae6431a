"""``/v1/admin/fleet``: the operator's live view of the fleet: the processes that run steps,
the queues, the task waiting longest, the sweeper's last run, and where Flower is."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from api.deps import Operator, SessionDep
from api.problems import responses
from shared.ops import fleet
from shared.ops.fleet import FleetUnavailable, SweepRecord, WorkerRecord

router = APIRouter(tags=["admin"])
RETRY_AFTER_SECONDS = 5


class WorkerOut(BaseModel):
    name: str = Field(description="the Celery worker's name, e.g. `w1@host`")
    host: str
    pid: int = Field(description="this process: the one that runs the steps")
    worker_pid: int = Field(
        description="the worker's main process: `pid` itself unless the pool is prefork"
    )
    pool: str = Field(description="the Celery pool: `prefork`, `threads`, `solo`, …")
    concurrency: int = Field(description="the worker's Celery concurrency (prefork: processes)")
    threads: int = Field(description="steps this process may run at once")
    busy: int = Field(description="steps running now")
    running: list[str] = Field(
        description=f"the ids of the tasks whose steps run now (at most {fleet.MAX_RUNNING})"
    )
    started_at: datetime
    last_seen: datetime = Field(description="its last heartbeat: when it last published this")

    @classmethod
    def of(cls, record: WorkerRecord) -> WorkerOut:
        return cls(
            **{
                **asdict(record),
                "running": list(record.running),
                "started_at": _at(record.started_at),
                "last_seen": _at(record.last_seen),
            }
        )


class QueueOut(BaseModel):
    name: str
    kind: str = Field(description="`steps` or `webhooks`")
    depth: int | None = Field(
        description="messages waiting; null when the broker cannot be looked into"
    )
    oldest_age_ms: int | None = Field(
        description="how long the next message has waited; null when none waits or the "
        "broker cannot tell (the in-process queue, or a message older than the visibility "
        "timeout)"
    )


class RunnableTaskOut(BaseModel):
    id: str
    status: str = Field(description="`queued`, or `running` without a live lease")
    due_at: datetime = Field(description="when its next step was due")
    overdue_ms: int = Field(description="how long past due, by the database's clock")


class SweepOut(BaseModel):
    process: str = Field(description="the worker's name and the sweeping process's pid")
    at: datetime
    tasks_resent: int = Field(description="tasks whose lost message it sent again")
    deliveries_resent: int = Field(description="webhook deliveries whose message it sent again")


class FleetOut(BaseModel):
    workers: list[WorkerOut] = Field(
        description="each process that runs steps and has published within its TTL"
    )
    queues: list[QueueOut]
    oldest_runnable_task: RunnableTaskOut | None = Field(
        description="the runnable task without a live lease due the longest; null if none"
    )
    sweeper: SweepOut | None = Field(description="the sweeper's last run; null if none")
    flower_url: str | None = Field(description="Flower, if `RATCHET_FLOWER_URL` is set")


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _sweep(sweep: SweepRecord | None) -> SweepOut | None:
    return None if sweep is None else SweepOut(**{**asdict(sweep), "at": _at(sweep.at)})


@router.get(
    "/v1/admin/fleet",
    summary="The fleet's live workers, queues and sweeper (operator)",
    responses=responses(
        {503: "the database or Redis (the live view, the broker) is unavailable; retry shortly"}
    ),
)
def fleet_view(_: Operator, session: SessionDep) -> FleetOut:
    """Every live process that runs steps (what it runs now and when it was last heard
    from), how many messages wait in each queue and for how long, the runnable task that has
    waited longest, the sweeper's last run, and the link to Flower (operator scope)."""
    try:
        with session.begin():
            live = fleet.view(session)
    except FleetUnavailable as exc:
        raise HTTPException(503, str(exc), {"Retry-After": str(RETRY_AFTER_SECONDS)}) from exc
    task = live.oldest_runnable_task
    return FleetOut(
        workers=[WorkerOut.of(w) for w in live.workers],
        queues=[QueueOut(**asdict(q)) for q in live.queues],
        oldest_runnable_task=None if task is None else RunnableTaskOut(**asdict(task)),
        sweeper=_sweep(live.sweeper),
        flower_url=live.flower_url,
    )
