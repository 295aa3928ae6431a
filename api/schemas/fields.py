"""The fields every request body shares: text without NUL, finite numbers, any JSON value,
and the OpenAPI document's word for the NUL rule."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, ConfigDict, Discriminator, Field, Tag, WithJsonSchema
from typing_extensions import TypeAliasType


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
