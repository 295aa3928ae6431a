"""``POST /v1/tasks/{id}/fork``: what a fork changes of its origin, and where it starts."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from api.schemas.fields import JsonValue, MetadataValue, ShortText, Text
from api.schemas.tasks import Budget, InputMessage, WebhookSpec

# What a fork may change of its origin's submission; everything else it inherits.
OVERRIDES = frozenset(
    {
        "input",
        "model",
        "model_options",
        "instructions",
        "tools",
        "max_steps",
        "budget",
        "webhook",
        "metadata",
        "stream",
    }
)


class TaskFork(BaseModel):
    """A new task whose history is the origin's steps 1..``from_step``, reused as they were
    committed (no model call asked again, no tool run again), which goes on at step
    ``from_step + 1``. Each other field, when given, replaces the origin's; when left out,
    the origin's holds (give ``null`` to clear ``instructions``, ``budget`` or ``webhook``)."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        json_schema_extra={
            "examples": [
                {"from_step": 2, "model": "openai:gpt-4o", "model_options": {"temperature": 0}}
            ]
        },
    )

    from_step: int = Field(
        ge=0,
        le=1_000_000,
        description="the last of the origin's steps the fork keeps: at most its committed "
        "steps (complete, every tool call settled); 0 starts afresh from its input",
    )
    input: (
        Annotated[Text, Field(min_length=1, max_length=200_000)]
        | Annotated[list[InputMessage], Field(min_length=1, max_length=500)]
        | None
    ) = Field(None, description="a replaced user input: the kept steps follow it")
    model: ShortText | None = Field(None, description="the model of the steps after the fork")
    model_options: dict[Text, JsonValue] | None = Field(
        None,
        description="replaces the origin's options (the `scripted` model's turn n still "
        "answers step n)",
    )
    instructions: Annotated[Text, Field(max_length=50_000)] | None = None
    tools: Annotated[list[ShortText], Field(max_length=100)] | None = Field(
        None, description="a subset of the agent's tools"
    )
    max_steps: int | None = Field(
        None, ge=1, description="counts the inherited steps too: more than `from_step`"
    )
    budget: Budget | None = Field(
        None, description="for the fork's own model calls (its usage starts at zero)"
    )
    webhook: WebhookSpec | None = None
    stream: bool | None = Field(
        None, description="whether the fork's model calls stream (left out: the origin's)"
    )
    metadata: (
        Annotated[dict[Annotated[Text, Field(max_length=100)], MetadataValue], Field(max_length=50)]
        | None
    ) = None
    tool_results: (
        Annotated[
            dict[Annotated[Text, Field(min_length=1, max_length=200)], JsonValue],
            Field(max_length=100),
        ]
        | None
    ) = Field(
        None,
        description="replaced outcomes of step `from_step`'s tool calls, by their provider "
        "call id (`provider_call_id` on `/steps`): each reaches the model as that call's "
        "successful result",
    )
