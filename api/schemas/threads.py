"""``/v1/threads``: a new thread, a thread as read, a turn's body, and the conversation."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.schemas.fields import MetadataValue, ShortText, Text
from api.schemas.tasks import TaskCreate
from shared.views import TaskView

ThreadStatus = Literal["idle", "busy", "awaiting_approval", "waiting", "error"]
MultitaskStrategy = Literal["reject", "enqueue", "interrupt", "rollback"]


class ThreadCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"agent": "default", "metadata": {"customer": "42"}}]},
    )

    agent: ShortText = Field("default", description="the agent every turn runs")
    metadata: Annotated[
        dict[Annotated[Text, Field(max_length=100)], MetadataValue], Field(max_length=50)
    ] = Field(
        default_factory=dict,
        description="yours: returned with the thread, and what `GET /v1/threads` filters on",
    )


class TurnCreate(TaskCreate):
    """A turn: a submission whose ``input`` is the new user message (the thread's history
    comes from its earlier turns, never from the client), and what to do if the thread has a
    turn unfinished. ``agent``, if given, must be the thread's."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        json_schema_extra={
            "examples": [{"input": "And what about next week?", "multitask_strategy": "enqueue"}]
        },
    )

    multitask_strategy: MultitaskStrategy = Field(
        "enqueue",
        description="if a turn is unfinished: `reject` (409), `enqueue` (run after it), "
        "`interrupt` (cancel it at its next commit point, keeping what it committed), "
        "`rollback` (cancel it and drop its turn from the history)",
    )


class ThreadFork(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"turn": 2}]})

    turn: int = Field(ge=1, le=2**31 - 1, description="the new thread holds turns 1..turn")
    metadata: (
        Annotated[dict[Annotated[Text, Field(max_length=100)], MetadataValue], Field(max_length=50)]
        | None
    ) = Field(None, description="the new thread's (default: the source thread's)")


class ForkOrigin(BaseModel):
    thread_id: str
    turn: int = Field(description="the source's turns 1..turn are this thread's first turns")


class ThreadView(BaseModel):
    id: str
    agent: str
    status: ThreadStatus = Field(description="as the latest turn leaves it")
    turns: int = Field(description="turns sent so far")
    metadata: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    latest_turn: TaskView | None = Field(description="the latest turn's task, if any")
    forked_from: ForkOrigin | None = Field(None, description="for a fork: its source")


class ThreadList(BaseModel):
    items: list[ThreadView]
    next_cursor: str | None


class MessageOut(BaseModel):
    """One message of the conversation, as the model reads it back."""

    turn: int
    task_id: str
    role: str = Field(description="`user`, `assistant` or `tool` (or as the input named it)")
    content: Any = Field(description="text, content parts, or for a tool its result or error")
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="an assistant message's tool calls: `id`, `name`, `arguments`"
    )
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")
    name: str | None = Field(None, description="a tool message: the tool")
    status: str | None = Field(None, description="a tool message: `succeeded` or `failed`")


class MessageList(BaseModel):
    items: list[MessageOut]
    next_cursor: str | None


def document_turn(components: dict[str, Any]) -> None:
    """Add a turn's body to an OpenAPI document's schemas (its route parses it itself, after
    auth), once the submit body is there (``document_submission``): the same fields, the
    script described as there, and ``multitask_strategy``."""
    body = TurnCreate.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(body.pop("$defs", {}))
    body["properties"]["model_options"] = components["TaskCreate"]["properties"]["model_options"]
    components["TurnCreate"] = body
