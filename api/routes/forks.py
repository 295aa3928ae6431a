"""``/v1/tasks/{id}/fork``: a new task from one of a task's committed steps."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request, Response

from api import fork_requests, idempotency
from api.deps import Writer, with_connection
from api.problems import responses
from api.schemas.forks import TaskFork
from shared.actions.tasks import Submitted
from shared.store.tenants import Principal
from shared.views import TaskView, task_view

router = APIRouter(prefix="/v1/tasks", tags=["tasks"])

FORK_RESPONSES = {
    **idempotency.accepted(
        "Accepted: the fork is queued (or, for a repeated Idempotency-Key, the fork that "
        "request made)",
        location="the fork's URL",
    ),
    **responses(
        {
            404: "no such task (another tenant's task is not found either)",
            409: "a request with the same Idempotency-Key is still in progress",
            422: "the body is invalid: `from_step` past the task's committed steps, a "
            "replaced tool result that names no call of that step, an unknown model or tool, "
            "`max_steps` not above `from_step`, or an Idempotency-Key reused with another body",
            429: "the tenant is over its submission rate limit, or holds its most queued "
            "tasks; nothing was created",
        }
    ),
}


@router.post(
    "/{task_id}/fork",
    status_code=202,
    response_model=TaskView,
    summary="Fork a task from one of its steps",
    responses=FORK_RESPONSES,
)
async def fork_task(
    request: Request,
    task_id: str,
    body: TaskFork,
    principal: Writer,
    response: Response,
    idempotency_key: Annotated[
        str | None, idempotency.key_header("the fork made the first time")
    ] = None,
) -> TaskView:
    """A new task (``forked_from`` names the origin) whose history is the task's steps
    1..``from_step``, reused as committed: none of their model calls is asked again and none
    of their tools runs again. It goes on at step ``from_step + 1`` with the fork's model,
    options, instructions and tools. The origin, in whatever state, is untouched. Needs the
    ``tasks:write`` scope."""
    done = await with_connection(request, _fork, principal, task_id, body, idempotency_key)
    idempotency.answer(response, location=f"/v1/tasks/{done.task.id}", replayed=done.replayed)
    return task_view(done.task)


def _fork(principal: Principal, task_id: str, body: TaskFork, key: str | None) -> Submitted:
    done = fork_requests.fork(principal.tenant_id, principal.tenant_name, task_id, body, key)
    return idempotency.after_submit(done)
