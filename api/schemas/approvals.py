"""``/v1/tasks/{id}/approvals``: a person's decision on a waiting tool call, and the answer."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.views import TaskView


class ApprovalDecision(BaseModel):
    model_config = ConfigDict(extra="forbid")

    decision: Literal["approve", "edit", "reject"]
    arguments: dict[str, Any] | None = Field(
        None, description="for `edit`: the arguments to run the call with (checked by its tool)"
    )
    reason: str | None = Field(None, max_length=2000, description="why; the model reads it")


class ApprovalOut(BaseModel):
    call_id: str
    tool: str
    arguments: dict[str, Any] = Field(description="as the call runs (edited, if it was)")
    original_arguments: dict[str, Any] | None = Field(description="the model's, if edited")
    decision: str
    decided_by: str
    decided_at: datetime | None
    reason: str | None
    replayed: bool = Field(description="this decision had been made before: nothing changed")
    task: TaskView
