"""``POST /v1/tasks/batch`` and ``GET /v1/batches/{id}``: many submissions in one request, the
answer for each, and a batch's tasks by status."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from api.problems import Problem
from api.schemas.tasks import MODEL_OPTIONS_EXAMPLE

# The most tasks a batch may ever hold: RATCHET_BATCH_MAX_TASKS (default 1,000) is at most this.
MAX_BATCH_TASKS = 10_000


class BatchCreate(BaseModel):
    """Tasks to submit in one request and one transaction. Each item is checked on its own: one
    that is not a valid submission is refused in its own answer, and the others go ahead."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "tasks": [
                        {"input": "What is 6*7?", "idempotency_key": "order-42"},
                        {
                            "input": "What is 6*7?",
                            "model": "scripted",
                            "model_options": MODEL_OPTIONS_EXAMPLE,
                        },
                    ]
                }
            ]
        },
    )

    tasks: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_BATCH_TASKS)] = Field(
        description="at most RATCHET_BATCH_MAX_TASKS (default 1,000) submit bodies "
        "(`TaskCreate`), each with an optional `idempotency_key` of its own: the same key "
        "and body as an earlier submission answers with that task"
    )


class BatchItem(BaseModel):
    """The answer for one item, in the request's order: its task, or why it was refused."""

    index: int = Field(description="the item's place in `tasks`, from 0")
    task_id: str | None = Field(None, description="its task; null when the item was refused")
    status: str | None = Field(None, description="the task's status now")
    replayed: bool = Field(
        False,
        description="the item's `idempotency_key` named a task submitted before (that task "
        "belongs to the batch it was submitted in, if any)",
    )
    error: Problem | None = Field(
        None, description="why the item was refused (a 422 problem naming `tasks[i]` fields)"
    )


class BatchSubmitted(BaseModel):
    batch_id: str
    created_at: datetime
    task_count: int = Field(description="the tasks this batch created")
    refused_count: int = Field(description="the items refused, each with its `error`")
    items: list[BatchItem]


class BatchView(BaseModel):
    """A batch's tasks by status; ``completed`` once every one of them has ended."""

    id: str
    created_at: datetime
    task_count: int = Field(description="the tasks this batch created")
    refused_count: int = Field(description="the items refused when it was submitted")
    completed: bool = Field(description="every task of the batch is terminal")
    counts: dict[str, int] = Field(description="how many of its tasks are in each status")
    tasks: dict[str, list[str]] = Field(description="its tasks' ids, by status")


def document_batch(components: dict[str, Any]) -> None:
    """Add the batch's body to an OpenAPI document's schemas (its route parses it itself,
    after auth)."""
    components["BatchCreate"] = BatchCreate.model_json_schema(
        ref_template="#/components/schemas/{model}"
    )
