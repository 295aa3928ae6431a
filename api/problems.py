"""RFC 9457 problem details: every error the API returns is ``application/problem+json``."""

from __future__ import annotations

import logging
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


def _pointer(loc: tuple[Any, ...]) -> tuple[str, str]:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    field = ""
    for part in parts:
        field += f"[{part}]" if part.isdigit() else (f".{part}" if field else part)
    return field or "(body)", "#/" + "/".join(parts)


def validation_errors(errors: list[dict[str, Any]]) -> list[dict[str, str]]:
    out = []
    for error in errors:
        field, pointer = _pointer(tuple(error.get("loc", ())))
        out.append({"field": field, "pointer": pointer, "detail": error.get("msg", "invalid")})
    return out


async def _validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = validation_errors(list(exc.errors()))
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
                "pointer": "#/" + exc.field.replace(".", "/"),
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
