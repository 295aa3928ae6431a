"""RFC 9457 problem details: every error the API returns is ``application/problem+json``."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.errors import (
    Conflict,
    DatabaseNotMigrated,
    EgressDenied,
    IdempotencyMismatch,
    InvalidRequest,
    NotFound,
    RatchetError,
)

log = logging.getLogger("ratchet.api")
MEDIA_TYPE = "application/problem+json"
TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def problem(
    status: int,
    detail: str,
    *,
    slug: str | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    title = TITLES.get(status, "Error")
    body = {
        "type": f"urn:ratchet:problem:{slug or title.lower().replace(' ', '-')}",
        "title": title,
        "status": status,
        "detail": detail,
        **extra,
    }
    return JSONResponse(body, status_code=status, media_type=MEDIA_TYPE, headers=headers)


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


async def _http(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return problem(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


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
    status = {
        NotFound: 404,
        Conflict: 409,
        IdempotencyMismatch: 422,
        DatabaseNotMigrated: 503,
    }.get(type(exc), 500)
    if status == 500:
        log.exception("unhandled domain error", exc_info=exc)
        return problem(500, "internal error")
    slug = {422: "idempotency-key-reused"}.get(status)
    return problem(status, str(exc), slug=slug)


async def _unhandled(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return problem(500, "internal error")


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(RatchetError, _domain)
    app.add_exception_handler(Exception, _unhandled)
