"""``/v1/tasks``: a submission, a page of tasks, and a task's steps with their tool calls
(the task itself answers as ``shared.views.TaskView``, which its webhooks carry too)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    HttpUrl,
    Tag,
    computed_field,
    model_validator,
)

from api.schemas.content import ContentPart, text_or_list
from api.schemas.fields import FINITE, JSON_VALUE_SCHEMA, JsonValue, MetadataValue, ShortText, Text
from api.schemas.webhooks import DEFAULT_WEBHOOK_EVENTS
from shared.mcp.names import server_of
from shared.model_strings import Script
from shared.store.events import EventType
from shared.views import TaskView, Usage

CONTENT_PARTS_EXAMPLE: Any = [
    {"type": "text", "text": "What is the total on this receipt?"},
    {"type": "image", "url": "https://example.com/receipt.png"},
]
OUTPUT_SCHEMA_EXAMPLE: Any = {
    "type": "object",
    "properties": {"total": {"type": "number"}, "currency": {"type": "string"}},
    "required": ["total", "currency"],
    "additionalProperties": False,
}
MODEL_OPTIONS_EXAMPLE: Any = {
    "script": [
        {"tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]},
        {"content": "The answer is 42."},
    ]
}


class InputMessage(BaseModel):
    """One chat message of a conversation given as ``input``. A user message may be a list of
    content parts: text, images and files."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"role": "user", "content": CONTENT_PARTS_EXAMPLE}]},
    )

    role: Literal["system", "user", "assistant"]
    content: Annotated[
        Annotated[Text, Field(max_length=200_000), Tag("text")]
        | Annotated[list[ContentPart], Field(min_length=1, max_length=100), Tag("parts")],
        Discriminator(text_or_list),
    ]

    @model_validator(mode="after")
    def _parts_from_the_user(self) -> InputMessage:
        if isinstance(self.content, list) and self.role != "user":
            raise ValueError(f"only a user message may have content parts, not a {self.role}'s")
        return self


class Budget(BaseModel):
    """Limits that end the task (failed, ``budget_exceeded``, with the reason in ``error``):
    before a model call whose worst case (its prompt plus all the answer may use,
    ``model_options.max_tokens``) could take the task past one, and after a call that did. A
    task may use its budget exactly."""

    model_config = FINITE

    max_tokens: int | None = Field(None, gt=0, description="input plus output tokens, in all")
    max_cost_usd: float | None = Field(
        None,
        gt=0,
        description="the model calls' cost in USD, at list prices: refused (422) for a model "
        "with no known price (RATCHET_PRICES_FILE prices it)",
    )


class ApprovalSpec(BaseModel):
    """Tools whose calls wait for a person's decision in this task (besides those that always
    ask), how long a decision may take, and what happens when none came."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    tools: Annotated[list[ShortText], Field(max_length=100)] = Field(
        default_factory=list, description="tool names, each one of the task's tools"
    )
    timeout_seconds: float | None = Field(
        None, gt=0, le=30 * 86_400, description="default: RATCHET_APPROVAL_TIMEOUT_SECONDS"
    )
    on_timeout: Literal["reject", "approve", "fail"] | None = Field(
        None, description="default: RATCHET_APPROVAL_ON_TIMEOUT"
    )


class WebhookSpec(BaseModel):
    """Where to POST the task's events (Standard Webhooks: signed, retried)."""

    model_config = ConfigDict(extra="forbid")

    url: HttpUrl = Field(description="https, and a public address unless allow-listed")
    events: list[EventType] = Field(
        default_factory=lambda: list(DEFAULT_WEBHOOK_EVENTS),
        max_length=9,
        description="which events to send",
    )


class ContextSpec(BaseModel):
    """How the task's prompt is kept inside its model's context window, with room for the
    answer (each field defaults to the agent's, then to the server's)."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["truncate", "summarize", "off"] | None = Field(
        None,
        description="`truncate`: keep the system prompt, the first user message and the most "
        "recent turns (a tool call and its result stay or go together); `summarize`: replace "
        "older turns with a summary written by a model call, committed once and shown in the "
        "step timeline; `off`: fail with `context_length_exceeded` instead of sending a prompt "
        "over the window. Default: the agent's, else RATCHET_CONTEXT_POLICY",
    )
    model: ShortText | None = Field(
        None,
        description="`summarize`: the model that writes the summaries (e.g. a cheaper one); "
        "default: the task's",
    )
    reserve_tokens: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="tokens kept free for the answer, less than the model's window; default: "
        "`model_options.max_tokens`, else RATCHET_CONTEXT_RESERVE_TOKENS (at most a quarter of "
        "the window)",
    )


MAX_DELAY_SECONDS = 366 * 86_400


class TaskCreate(BaseModel):
    """What a client submits. Only ``input`` is required."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        json_schema_extra={
            "not": {"required": ["run_at", "delay_seconds"]},  # one of them at most
            "examples": [
                {
                    "input": "What is 6*7?",
                    "model": "scripted",
                    "model_options": MODEL_OPTIONS_EXAMPLE,
                    "budget": {"max_tokens": 200000, "max_cost_usd": 2.0},
                    "metadata": {"customer": "42"},
                }
            ],
        },
    )

    agent: ShortText = Field("default", description="a registered agent (`GET /v1/agents`)")
    input: (
        Annotated[Text, Field(min_length=1, max_length=200_000)]
        | Annotated[list[InputMessage], Field(min_length=1, max_length=500)]
    ) = Field(
        description="the user's request as text, or a conversation as chat messages (a user "
        "message may carry text, image and file parts)"
    )
    model: ShortText | None = Field(
        None,
        description="`provider:model` (`openai:gpt-4o-mini`, `anthropic:…`) or `scripted`; "
        "default: the agent's, else the server's",
    )
    model_options: dict[Text, JsonValue] = Field(
        default_factory=dict,
        description="options passed to the model; the `scripted` model reads `script`, a list "
        "of turns: the n-th model call of the task answers with turn n",
        examples=[{"temperature": 0}, MODEL_OPTIONS_EXAMPLE],
    )
    instructions: Annotated[Text, Field(max_length=50_000)] | None = Field(
        None, description="an extra system prompt, after the agent's"
    )
    tools: Annotated[list[ShortText], Field(max_length=100)] | None = Field(
        None, description="a subset of the agent's tools (default: all of them)"
    )
    max_steps: int | None = Field(
        None, ge=1, description="at most this many steps (default: the agent's)"
    )
    budget: Budget | None = None
    context: ContextSpec | None = None
    webhook: WebhookSpec | None = None
    approval: ApprovalSpec | None = None
    priority: int = Field(
        0,
        ge=-10,
        le=10,
        description="higher runs first among this tenant's tasks (never ahead of another "
        "tenant's fair share)",
    )
    run_at: AwareDatetime | None = Field(
        None, description="not before this time (with its UTC offset); at most a year ahead"
    )
    delay_seconds: float | None = Field(
        None, ge=0, le=MAX_DELAY_SECONDS, description="not before this many seconds from now"
    )
    metadata: Annotated[
        dict[Annotated[Text, Field(max_length=100)], MetadataValue], Field(max_length=50)
    ] = Field(default_factory=dict, description="yours: returned with the task, never read")
    output_schema: dict[Text, JsonValue] | None = Field(
        None,
        description="a JSON Schema the final answer must meet (default: the agent's). The "
        "model is asked for it in its provider's structured-output mode; an answer that is not "
        "JSON or misses the schema goes back to the model with the error, up to "
        "RATCHET_OUTPUT_RETRIES times, then the task fails with `invalid_output`. On success "
        "`result.output` is the parsed JSON value. Only references inside the schema (`#…`); "
        "at most RATCHET_OUTPUT_SCHEMA_MAX_BYTES",
        examples=[OUTPUT_SCHEMA_EXAMPLE],
    )
    stream: bool | None = Field(
        None,
        description="whether its model calls stream their answers to the task's event stream "
        "as `message.delta` events while the model writes (default: the agent's choice, else "
        "RATCHET_STREAM_DEFAULT, on). Off, each call asks for the whole answer at once",
    )


class TaskList(BaseModel):
    items: list[TaskView]
    next_cursor: str | None


class ToolCallOut(BaseModel):
    call_id: str = Field(description="the call's id, as events name it: `<step>-<position>`")
    provider_call_id: str
    name: str
    arguments: dict[str, Any]
    status: str
    result: Any
    error: str | None
    idempotency_key: str
    runs: int = Field(
        description="how many times the call was started: a crash between a start and its "
        "outcome leaves the run unknown, and an idempotent call is then run again (so its "
        "effect happened at most this many times, and at least once if it succeeded)"
    )
    started_at: datetime
    finished_at: datetime | None
    approval: CallApproval | None = Field(
        None, description="for a call that needed a person's decision: its deadline and decision"
    )
    wait: dict[str, Any] | None = Field(
        None,
        description="for a call that parked (a durable wait, or a sub-agent's child task): "
        "its token, kind, child_id, status, request, deadline and on_timeout",
    )

    @computed_field(  # type: ignore[prop-decorator]
        description="the MCP server the call went to (its tool is named `<server>.<tool>`); "
        "null for a Python tool"
    )
    @property
    def server(self) -> str | None:
        return server_of(self.name)


class CallApproval(BaseModel):
    deadline: datetime | None
    on_timeout: str | None
    decision: str | None = Field(description="approve, edit or reject; null while it waits")
    decided_by: str | None = Field(description="`key:<id>`, or `timeout`")
    decided_at: datetime | None
    reason: str | None
    original_arguments: dict[str, Any] | None = Field(description="the model's, if edited")


class StepUsage(Usage):
    """A step's usage, with the size of the prompt it sent."""

    prompt_tokens: int = Field(
        0,
        description="the prompt this step's model call sent, in tokens (the provider's count, "
        "else Ratchet's own before the call): what the task's context policy kept of the "
        "conversation",
    )


class SummaryOut(BaseModel):
    """A summary the task's `summarize` context policy committed: in every later prompt it
    stands for the conversation through `through_step`; each builds on the one before."""

    number: int
    through_step: int
    content: str
    model: str = Field(description="the model that wrote it")
    usage: Usage = Field(description="its model call's, counted in the task's usage and budget")
    created_at: datetime


class StepOut(BaseModel):
    number: int
    forked: bool = Field(
        False,
        description="a step a fork inherited from its origin (see the task's `forked_from`): "
        "committed there, reused here as it was, its usage counted in the origin's",
    )
    status: str
    model: dict[str, Any] = Field(
        description="the model's answer: `content` and `tool_calls`, and `output_error` when it "
        "was a final answer that missed the task's `output_schema` (the model read it back and "
        "answered again in the next step)"
    )
    usage: StepUsage
    model_latency_ms: int
    started_at: datetime
    model_completed_at: datetime
    completed_at: datetime | None
    tool_calls: list[ToolCallOut]


class FailedModelCall(BaseModel):
    started_at: datetime
    latency_ms: int
    error: dict[str, Any] = Field(description="`type` and `message`")


class StepList(BaseModel):
    items: list[StepOut]
    next_cursor: str | None
    waiting: dict[str, Any] | None = Field(
        None, description="why the next step has not run yet (rate_limited, retry_backoff, …)"
    )
    failed_model_calls: list[FailedModelCall] = Field(
        default_factory=list,
        description="the next step's model calls that failed (when, how long, the error): "
        "the step has no entry in `items` until its model answers",
    )
    summaries: list[SummaryOut] = Field(
        default_factory=list,
        description="the summaries of earlier turns that the task's `summarize` context policy "
        "committed, oldest first (on every page)",
    )


def document_submission(components: dict[str, Any]) -> None:
    """Add the submit body to an OpenAPI document's schemas, with what pydantic cannot say
    there (it resolves every ``$ref`` it meets): JSON values without NUL, and the script."""
    refs = "#/components/schemas/{model}"
    body = TaskCreate.model_json_schema(ref_template=refs)
    script = Script.model_json_schema(ref_template=refs)
    components.update(body.pop("$defs", {}))
    components.update(script.pop("$defs", {}))
    components["JsonValue"] = JSON_VALUE_SCHEMA
    body["properties"]["model_options"]["properties"] = {"script": script["properties"]["script"]}
    components["TaskCreate"] = body
