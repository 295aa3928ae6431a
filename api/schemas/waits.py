"""``/v1/waits/{token}``: a durable wait as its completer reads it, and the completion's answer."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field


class WaitOut(BaseModel):
    token: str
    task_id: str
    call_id: str
    kind: str = Field(
        description="`token` (completed from outside) or `child` (a sub-agent's task)"
    )
    child_id: str | None = Field(description="for a `child` wait: the child task")
    status: str = Field(description="pending, completed, failed, expired or cancelled")
    request: Any = Field(description="what the tool said it waits for (e.g. a question)")
    result: Any = Field(description="the completion's body (the call's result), once completed")
    error: str | None
    deadline: datetime | None
    on_timeout: str = Field(description="at the deadline: fail_call, tell_model or fail_task")
    created_at: datetime
    settled_at: datetime | None
    settled_by: str | None
