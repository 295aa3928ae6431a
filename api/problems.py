"""RFC 9457 problem details: every error the API returns is ``application/problem+json``."""

from __future__ import annotations

import logging
import re
import traceback
from http import HTTPStatus
from typing import Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.errors import (
    Conflict,
    DatabaseNotMigrated,
    EgressDenied,
    IdempotencyMismatch,
    InvalidRequest,
    NotFound,
    QueueFull,
    RatchetError,
)

log = logging.getLogger("ratchet.api")
MEDIA_TYPE = "application/problem+json"
# What a client waits before trying again when the database is down or overloaded.
DATABASE_RETRY_AFTER_SECONDS = 5
# The database cannot be reached, went silent, refused a connection, cancelled a statement
# that ran past its timeout, or every pooled connection stayed busy past the pool's timeout.
DATABASE_UNAVAILABLE = (sa_exc.OperationalError, sa_exc.TimeoutError, psycopg.OperationalError)


METHODS = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")
# Type URNs stay put when Python renames a reason phrase (3.13 took RFC 9110's names for these).
STABLE_SLUGS = {413: "content-too-large", 422: "unprocessable-content"}
# Why the API may answer each status, for the OpenAPI document; a route adds its own reasons.
REASONS = {
    400: "more than one Authorization header, or an API key in the query string",
    401: "no API key, or one that is unknown, revoked or expired",
    403: "the API key lacks the scope this operation needs",
    404: "not found, or another tenant's",
    413: "the request body is over the size limit (RATCHET_MAX_REQUEST_BYTES)",
    422: "a parameter or the body is invalid; ``errors`` names each bad field",
    431: "the request head has too many or too large header fields (served by uvicorn)",
    503: "the database is unavailable; retry after ``Retry-After`` seconds",
}
RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before trying again",
        "schema": {"type": "integer", "minimum": 1},
    }
}


def responses(reasons: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the error statuses a route may answer: each a problem, with
    an example of its own status (the docs pages show it under that status)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status, reason in reasons.items():
        schema = {"$ref": "#/components/schemas/Problem"}
        out[status] = {
            "description": f"{title(status)}: {reason}",
            "content": {MEDIA_TYPE: {"schema": schema, "example": example(status, reason)}},
        }
        if status in (429, 503):
            out[status]["headers"] = RETRY_AFTER
    return out


def example(status: int, reason: str) -> dict[str, Any]:
    """A problem as the API would answer ``status`` for ``reason``."""
    body: dict[str, Any] = {
        "type": f"urn:ratchet:problem:{EXAMPLE_SLUGS.get(status) or _slug(status)}",
        "title": title(status),
        "status": status,
        "detail": " ".join(reason.replace("``", "").split()),
    }
    if status == 422:
        body["errors"] = [FIELD_ERROR_EXAMPLE]
    return body


# The type a route's problem of that status most often has (``problem(...)``'s ``slug``).
EXAMPLE_SLUGS = {422: "validation-error", 503: "database-unavailable"}
FIELD_ERROR_EXAMPLE = {"field": "tools[0]", "pointer": "#/tools/0", "detail": "unknown tool 'nope'"}


def title(status: int) -> str:
    """The problem's title for ``status``: the reason phrase uvicorn writes on the status line
    (Python's ``HTTPStatus``), so the body and the status line always agree."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


class FieldError(BaseModel):
    field: str = Field(description="the field, as a readable path", examples=["tools[0]"])
    pointer: str = Field(
        description="the field as a JSON pointer into the request", examples=["#/tools/0"]
    )
    detail: str = Field(description="what is wrong with it", examples=["unknown tool 'nope'"])


class Problem(BaseModel):
    """An RFC 9457 problem: the body of every error the API returns."""

    # No example here: each response carries one of its own status (``responses``), which
    # the docs pages would otherwise show as this schema's one example under every status.
    model_config = ConfigDict(
        extra="allow",  # a problem may carry more members (``/readyz`` adds ``checks``)
    )

    type: str = Field(description="a URN naming the kind of problem")
    title: str = Field(description="the HTTP reason phrase of ``status``")
    status: int = Field(description="the HTTP status code")
    detail: str = Field(description="what went wrong, for a person to read")
    errors: list[FieldError] | SkipJsonSchema[None] = Field(
        None, description="validation failures only: one entry per bad field"
    )


def problem(
    status: int,
    detail: str,
    *,
    slug: str | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    phrase = title(status)
    body = {
        "type": f"urn:ratchet:problem:{slug or _slug(status)}",
        "title": phrase,
        "status": status,
        "detail": detail,
        **extra,
    }
    return JSONResponse(body, status_code=status, media_type=MEDIA_TYPE, headers=headers)


def _slug(status: int) -> str:
    return STABLE_SLUGS.get(status) or title(status).lower().replace(" ", "-")


def field_name(parts: list[str | int]) -> tuple[str, str]:
    """``["tools", 0]`` → ``("tools[0]", "#/tools/0")``: a readable name and a JSON pointer."""
    field = ""
    for part in parts:
        if isinstance(part, int):
            field += f"[{part}]"
        else:
            field += f".{part}" if field else part
    pointer = "#/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in parts)
    return field or "(body)", pointer


def parse_field(field: str) -> list[str | int]:
    """``tools[0].name`` → ``["tools", 0, "name"]``, the inverse of :func:`field_name`."""
    parts: list[str | int] = []
    for token in re.findall(r"[^.\[\]]+|\[\d+\]", field):
        parts.append(int(token[1:-1]) if token.startswith("[") else token)
    return parts


def _document_path(error: dict[str, Any], document: Any) -> list[str | int]:
    """The error's location within the submitted document.

    Pydantic's ``loc`` also names union members (``constrained-str``, ``list[Message]``) and
    the source (``body``); only keys and indexes that exist in the document are kept, plus the
    name of a missing field.
    """
    loc = list(error.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path", "header"):
        source, loc = loc[0], loc[1:]
        if source != "body":
            return [str(p) for p in loc]
    if error.get("type") == "json_invalid":
        return []
    path: list[str | int] = []
    current = document
    missing = error.get("type") == "missing"
    for index, part in enumerate(loc):
        exists = (isinstance(current, dict) and isinstance(part, str) and part in current) or (
            isinstance(current, list) and isinstance(part, int) and 0 <= part < len(current)
        )
        if exists:
            current = current[part]
        elif not (missing and isinstance(current, dict) and index == len(loc) - 1):
            continue
        path.append(part)
    return path


def validation_errors(errors: list[dict[str, Any]], document: Any = None) -> list[dict[str, str]]:
    out = []
    for error in errors:
        field, pointer = field_name(_document_path(error, document))
        out.append({"field": field, "pointer": pointer, "detail": error.get("msg", "invalid")})
    return out


async def _validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = validation_errors(list(exc.errors()), exc.body)
    detail = "; ".join(f"{e['field']}: {e['detail']}" for e in errors)
    return problem(422, detail, slug="validation-error", errors=errors)


async def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    headers = getattr(exc, "headers", None)
    if exc.status_code == 405:
        headers = {**(headers or {}), "Allow": allowed_methods(request)}
    return problem(exc.status_code, str(exc.detail), headers=headers)


def allowed_methods(request: Request) -> str:
    """Every method some route serves at the request's path, for a 405's ``Allow``.

    Starlette answers a 405 from the first route whose path matched, naming its methods
    only; a path is often served by several routes (``GET`` and ``POST /v1/tasks``). Each
    method is tried against the router as a request of that method would be."""
    routes = request.app.router.routes
    allowed = [
        method
        for method in METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes
        )
    ]
    return ", ".join(allowed)


async def _domain(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RatchetError)
    if isinstance(exc, InvalidRequest):
        errors = [
            {
                "field": exc.field,
                "pointer": field_name(parse_field(exc.field))[1],
                "detail": exc.reason,
            }
        ]
        return problem(422, str(exc), slug="validation-error", errors=errors)
    if isinstance(exc, EgressDenied):
        return problem(422, str(exc), slug="validation-error")
    if isinstance(exc, QueueFull):
        headers = {"Retry-After": str(exc.retry_after_s)}
        return problem(429, str(exc), slug="queue-full", headers=headers)
    statuses: dict[type, int] = {
        NotFound: 404,
        Conflict: 409,
        IdempotencyMismatch: 422,
        DatabaseNotMigrated: 503,
    }
    # A subclass answers as its base does (``SecretsNotConfigured`` is a Conflict).
    status = next((statuses[t] for t in type(exc).__mro__ if t in statuses), 500)
    if status == 500:
        log_unexpected(exc)
        return problem(500, "internal error")
    slug = {422: "idempotency-key-reused"}.get(status)
    return problem(status, str(exc), slug=slug)


async def _database_unavailable(_: Request, exc: Exception) -> JSONResponse:
    # The driver's own first line says why (refused, timed out, cancelled); never the
    # statement or its parameters.
    cause = getattr(exc, "orig", None) or exc
    reason = (str(cause).strip().splitlines() or [""])[0]
    log.warning("database unavailable: %s: %s", type(cause).__name__, reason)
    return problem(
        503,
        "the database is unavailable; try again shortly",
        slug="database-unavailable",
        headers={"Retry-After": str(DATABASE_RETRY_AFTER_SECONDS)},
    )


def log_unexpected(exc: BaseException) -> None:
    """One error record: the exception types and where they were raised, without their
    messages, which may quote the request (a body, a statement's parameters)."""
    lines: list[str] = []
    current: BaseException | None = exc
    while current is not None and len(lines) < 10:  # a chain is short; never a loop
        name = f"{type(current).__module__}.{type(current).__qualname__}"
        lines.append(f"{name}, raised at:\n{''.join(traceback.format_tb(current.__traceback__))}")
        current = current.__cause__ or current.__context__
    log.error("unhandled error: %s", "\ncaused by ".join(lines).rstrip())


class UnhandledErrors:
    """The last resort: an error no handler took is logged once (:func:`log_unexpected`) and
    answered with a bare 500 problem. Starlette's own last resort re-raises it to the server,
    which logs it again with its message."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except StarletteHTTPException:
            raise  # a body over the limit, met while streaming: the body limit answers it
        except ClientDisconnect:
            # The client left before its body arrived (or it was too late, which the server
            # logged): no one to answer, nothing unexpected to log.
            return
        except Exception as exc:
            log_unexpected(exc)
            if not started:
                await problem(500, "internal error")(scope, receive, send)


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(RatchetError, _domain)
    for error in DATABASE_UNAVAILABLE:
        app.add_exception_handler(error, _database_unavailable)
    app.add_middleware(UnhandledErrors)
