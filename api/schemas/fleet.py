"""``/v1/admin/fleet``: the workers, the queues, the oldest runnable task and the sweeper."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime

from pydantic import BaseModel, Field

from shared.ops import fleet
from shared.ops.fleet import SweepRecord, WorkerRecord


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

    @classmethod
    def of(cls, record: SweepRecord) -> SweepOut:
        return cls(**{**asdict(record), "at": _at(record.at)})


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
