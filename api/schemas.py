"""Request and response bodies. Pydantic classes, never ORM models."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    HttpUrl,
    Tag,
    WithJsonSchema,
)
from typing_extensions import TypeAliasType

from shared.model_strings import Script
from shared.store.events import EventType
from shared.views import TaskView, Usage

DEFAULT_WEBHOOK_EVENTS: tuple[EventType, ...] = ("task.succeeded", "task.failed", "task.cancelled")


def _no_nul(value: str) -> str:
    # PostgreSQL can store no NUL character in text or jsonb: refuse it here, by field name,
    # rather than fail the insert.
    if "\x00" in value:
        raise ValueError("must not contain the NUL character (\\u0000)")
    return value


def _json_kind(value: Any) -> str:
    """Which member of a JSON union a value is, so a bad value reports only that member's error."""
    if isinstance(value, bool):  # before int: a bool is an int
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    return "array" if isinstance(value, list) else "null"


# The schema's way of saying _no_nul, so a client (or a fuzzer) knows the rule too.
NO_NUL = "^[^\\x00]*$"
Text = Annotated[str, AfterValidator(_no_nul), Field(json_schema_extra={"pattern": NO_NUL})]
ShortText = Annotated[Text, Field(min_length=1, max_length=200)]
# Models that hold floats refuse NaN and ±Infinity (JSON has neither; 1e400 parses as inf).
FINITE = ConfigDict(extra="forbid", allow_inf_nan=False)
Scalar = (
    Annotated[Text, Tag("string")]
    | Annotated[bool, Tag("boolean")]
    | Annotated[int, Tag("integer")]
    | Annotated[float, Field(allow_inf_nan=False), Tag("number")]
    | Annotated[None, Tag("null")]
)
# The schemas say "any JSON value" plainly: the tagged union's own would be a oneOf in
# which an integer matches two members (integer and number), so no integer could pass.
MetadataValue = Annotated[
    Scalar,
    Discriminator(_json_kind),
    WithJsonSchema({"type": ["string", "number", "boolean", "null"], "pattern": NO_NUL}),
]
if TYPE_CHECKING:  # mypy cannot follow the recursive alias below
    JsonValue = Any
else:
    JsonValue = TypeAliasType(
        "JsonValue",
        Annotated[
            Scalar
            | Annotated[list["JsonValue"], Tag("array")]
            | Annotated[dict[Text, "JsonValue"], Tag("object")],
            Discriminator(_json_kind),
            WithJsonSchema({}),  # the OpenAPI document says more: JSON_VALUE_SCHEMA
        ],
    )
# Any JSON value with no NUL in a string or a key: each keyword applies to one JSON type
# only, so together they constrain strings, arrays and objects, at any depth. (Set in the
# OpenAPI document, not above: pydantic resolves every $ref it is given.)
JSON_VALUE_SCHEMA = {
    "description": "any JSON value; no string or key holds a NUL character",
    "pattern": NO_NUL,
    "items": {"$ref": "#/components/schemas/JsonValue"},
    "propertyNames": {"pattern": NO_NUL},
    "additionalProperties": {"$ref": "#/components/schemas/JsonValue"},
}


MODEL_OPTIONS_EXAMPLE: Any = {
    "script": [
        {"tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]},
        {"content": "The answer is 42."},
    ]
}


class InputMessage(BaseModel):
    """One chat message of a conversation given as ``input``."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: Annotated[Text, Field(max_length=200_000)]


class Budget(BaseModel):
    """Limits that end the task (failed, with the reason in ``error``) when a model call takes
    it past one: a task may use its budget exactly."""

    model_config = FINITE

    max_tokens: int | None = Field(None, gt=0, description="input plus output tokens, in all")
    max_cost_usd: float | None = Field(None, gt=0, description="the model calls' cost, in USD")


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
    ) = Field(description="the user's request as text, or a conversation as chat messages")
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


class CallApproval(BaseModel):
    deadline: datetime | None
    on_timeout: str | None
    decision: str | None = Field(description="approve, edit or reject; null while it waits")
    decided_by: str | None = Field(description="`key:<id>`, or `timeout`")
    decided_at: datetime | None
    reason: str | None
    original_arguments: dict[str, Any] | None = Field(description="the model's, if edited")


class StepOut(BaseModel):
    number: int
    status: str
    model: dict[str, Any]
    usage: Usage
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


class ToolOut(BaseModel):
    name: str
    description: str
    parameters: dict[str, Any]
    idempotent: bool
    requires_approval: bool = Field(
        description="whether its calls wait for a person: always, or as a predicate over the "
        "arguments decides (a submission may ask for more)"
    )
    timeout: float | None


class AgentOut(BaseModel):
    name: str
    description: str
    model: str | None
    max_steps: int | None
    tools: list[ToolOut]


class AgentList(BaseModel):
    items: list[AgentOut]
    next_cursor: str | None


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


def forbid_nul_in_request_bodies(document: dict[str, Any]) -> None:
    """Say in the schema of every request body what api/body_text.py enforces on all of them:
    no string or key holds a NUL. A string with a pattern, a format or an enum of its own
    already rules it out; an object of free-form values gets ``JsonValue``'s."""
    components = document.get("components", {}).get("schemas", {})
    seen: set[str] = set()
    pending: list[Any] = [
        media.get("schema")
        for path in document.get("paths", {}).values()
        for operation in path.values()
        if isinstance(operation, dict)
        for media in operation.get("requestBody", {}).get("content", {}).values()
    ]
    while pending:
        schema = pending.pop()
        if isinstance(schema, list):
            pending.extend(schema)
        if not isinstance(schema, dict):
            continue
        ref = schema.get("$ref", "")
        name = ref.rpartition("/")[2]
        if ref.startswith("#/components/schemas/") and name not in seen:
            seen.add(name)
            pending.append(components.get(name))
        _forbid_nul(schema)
        pending.extend(v for k, v in schema.items() if k not in ("examples", "example", "enum"))


def _forbid_nul(schema: dict[str, Any]) -> None:
    if schema.get("type") == "string" and not {"pattern", "format", "enum", "const"} & set(schema):
        schema["pattern"] = NO_NUL
    if schema.get("type") == "object" and schema.get("additionalProperties") is True:
        schema["additionalProperties"] = {"$ref": "#/components/schemas/JsonValue"}
    if schema.get("type") == "object" and "additionalProperties" in schema:
        schema.setdefault("propertyNames", {"pattern": NO_NUL})
