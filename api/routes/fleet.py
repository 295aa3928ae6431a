"""``/v1/admin/fleet``: the operator's live view of the fleet: the processes that run steps,
the queues, the task waiting longest, the sweeper's last run, and where Flower is."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, HTTPException

from api.deps import Operator, SessionDep
from api.problems import responses
from api.schemas.fleet import FleetOut, QueueOut, RunnableTaskOut, SweepOut, WorkerOut
from shared.ops import fleet
from shared.ops.fleet import FleetUnavailable

router = APIRouter(tags=["admin"])
RETRY_AFTER_SECONDS = 5


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
        sweeper=None if live.sweeper is None else SweepOut.of(live.sweeper),
        flower_url=live.flower_url,
    )
