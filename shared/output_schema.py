"""A task's ``output_schema``: the JSON Schema its final answer must meet.

The schema is checked once, where it enters (a submission, an agent's registration): it must
be a schema of a draft ``jsonschema`` knows, within ``RATCHET_OUTPUT_SCHEMA_MAX_BYTES``, and
refer only to itself (``$ref`` to ``#…``): Ratchet never fetches a schema from anywhere, so a
reference it could not resolve at submission would fail every answer later. A final answer is
then parsed as JSON and validated against it; what is wrong goes back to the model in words.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import SchemaError, relevance
from jsonschema.protocols import Validator
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012, specification_with

from shared.errors import InvalidRequest

# An agent's schema is checked as it registers, before any setting is read: the submission
# checks it against RATCHET_OUTPUT_SCHEMA_MAX_BYTES too.
MAX_AGENT_SCHEMA_BYTES = 1_048_576
MAX_ERROR_CHARS = 600  # of one validation error as the model reads it (it may quote the answer)
MAX_ERRORS = 5  # of one answer, the most relevant first, for the model to correct at once


def check_schema(schema: Any, *, max_bytes: int, field: str = "output_schema") -> None:
    """Refuse (``InvalidRequest`` naming ``field`` and the problem) a schema no answer could
    be checked against: not an object, too large, of an unknown draft, invalid under its
    draft's meta-schema, or referring to anything but itself."""
    if not isinstance(schema, dict):
        raise InvalidRequest(field, "must be a JSON Schema object")
    text = json.dumps(schema, separators=(",", ":"), sort_keys=True)
    size = len(text.encode())
    if size > max_bytes:
        raise InvalidRequest(
            field, f"is {size} bytes; at most {max_bytes} (RATCHET_OUTPUT_SCHEMA_MAX_BYTES)"
        )
    _check_content(text, field)


@lru_cache(maxsize=256)
def _check_content(text: str, field: str) -> None:
    """The checks of a schema's content, kept per schema (an agent's comes with every one of
    its submissions, and the meta-schema's validation costs milliseconds): a schema that
    passed once passes again; one that failed raises, and is not kept."""
    schema = json.loads(text)
    cls = _validator_class(schema, field)
    try:
        cls.check_schema(schema)
    except SchemaError as exc:
        raise InvalidRequest(_where(field, exc.absolute_path), _short(exc.message)) from None
    _check_references(schema, field)


def problem(schema: dict[str, Any], text: str | None) -> tuple[Any, str | None]:
    """The answer ``text`` parsed, and what is wrong with it (None: it meets ``schema``)."""
    try:
        value = json.loads(text or "")
    except ValueError as exc:
        return None, f"the answer is not JSON ({exc})"
    validator = _validator_class(schema, "output_schema")(schema)
    try:
        errors = sorted(validator.iter_errors(value), key=relevance, reverse=True)[:MAX_ERRORS]
    except Unresolvable as exc:  # checked at submission: only a schema from before that
        return value, f"the output schema cannot be resolved: {exc}"
    if not errors:
        return value, None
    said = [f"{_where('the answer', e.absolute_path)}: {_short(e.message)}" for e in errors]
    return value, "; ".join(said)


def _validator_class(schema: dict[str, Any], field: str) -> type[Validator]:
    cls: type[Validator] | None = validators.validator_for(schema, default=None)  # type: ignore[arg-type]
    if "$schema" not in schema:
        return Draft202012Validator
    if cls is None:
        raise InvalidRequest(f"{field}.$schema", f"unknown JSON Schema draft {schema['$schema']!r}")
    return cls


def _check_references(schema: dict[str, Any], field: str) -> None:
    """Every ``$ref`` points inside the schema, at something that is there."""
    specification = specification_with(str(schema.get("$schema", "")), default=DRAFT202012)
    resolver = Registry().with_resource("", specification.create_resource(schema)).resolver()
    for path, ref in _references(schema, ()):
        if not ref.startswith("#"):
            raise InvalidRequest(
                _where(field, path), f"{ref!r}: only references inside the schema (#…) are allowed"
            )
        try:
            resolver.lookup(ref)
        except Unresolvable:
            raise InvalidRequest(_where(field, path), f"{ref!r} points at nothing") from None


def _references(node: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("$ref", "$dynamicRef") and isinstance(value, str):
                yield (*path, key), value
            else:
                yield from _references(value, (*path, key))
    elif isinstance(node, list):
        for index, item in enumerate(node):
            yield from _references(item, (*path, index))


def _where(root: str, path: Any) -> str:
    """``root.a.b[0]``: where in a document a problem is."""
    where = root
    for part in path:
        where += f"[{part}]" if isinstance(part, int) else f".{part}"
    return where


def _short(message: str) -> str:
    """A message cut in its middle (where it quotes a long value), keeping what it says."""
    if len(message) <= MAX_ERROR_CHARS:
        return message
    half = MAX_ERROR_CHARS // 2
    return f"{message[:half]}…{message[-half:]}"
