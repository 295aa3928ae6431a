"""``POST /v1/tasks/{id}/approvals/{call_id}``: a person's decision on a tool call that waits
for one. Scope ``tasks:approve`` (which ``tasks:write`` includes)."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import Approver, SessionDep
from api.problems import responses
from api.schemas.approvals import ApprovalDecision, ApprovalOut
from shared.actions import approvals
from shared.actions.effects import after_commit
from shared.approvals.decisions import Decided
from shared.views import aware, task_view

router = APIRouter(prefix="/v1/tasks", tags=["tasks"])


def approval_out(decided: Decided) -> ApprovalOut:
    call = decided.call
    return ApprovalOut(
        call_id=call.call_id,
        tool=call.tool,
        arguments=call.arguments,
        original_arguments=call.original_arguments,
        decision=call.decision or "",
        decided_by=call.decided_by or "",
        decided_at=aware(call.decided_at),
        reason=call.decision_reason,
        replayed=decided.replayed,
        task=task_view(decided.task, approval_links=True),  # the caller may decide
    )


@router.post(
    "/{task_id}/approvals/{call_id}",
    response_model=ApprovalOut,
    summary="Approve, edit or reject a waiting tool call",
    responses=responses(
        {
            404: "no such task, or no such call waiting for a decision",
            409: "the call was already decided otherwise, or its task no longer waits",
            422: "the body is invalid, or an edit's arguments do not fit the tool",
        }
    ),
)
def decide_call(
    task_id: str, call_id: str, body: ApprovalDecision, principal: Approver, session: SessionDep
) -> ApprovalOut:
    """Decide once: the same decision again answers with the stored one (``replayed``); a
    different one is a 409. When the step's last waiting call is decided, the task runs on:
    approved calls run once (edited ones with the new arguments), and the model reads each
    rejection with its reason."""
    decided, effects = approvals.decide(
        session,
        task_id,
        call_id,
        decision=body.decision,
        decided_by=f"key:{principal.key_id}",
        tenant_id=principal.tenant_id,
        arguments=body.arguments,
        reason=body.reason,
    )
    out = approval_out(decided)
    after_commit(effects)
    return out
