"""Refuse, in any request body, text that no column can hold: a 422 naming the field.

PostgreSQL stores no NUL character in ``text`` or ``jsonb``, and a lone surrogate (``\\ud800``
with no partner) is not Unicode: it cannot even be encoded as UTF-8 to be sent to the
database. JSON can spell both (``"\\u0000"``, ``"\\ud800"``) and Python's JSON parser reads them
as they are, so every route that stored such a string failed with a 500. This middleware
checks every JSON or form body once, before any route reads it, so no route has to remember.

A body is read whole (it is bounded by ``max_request_bytes``, see api/body_limit.py) and
handed on unchanged. Most bodies hold no ``\\u`` escape nor ``%00`` at all, and cost a scan of
their bytes; only a body that might hold one is parsed here to find and name the field.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.problems import field_name, problem

BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# An escape that may decode to a NUL or a surrogate; a false alarm (an escaped backslash
# before it, or a surrogate with its partner) only costs a parse.
MAYBE_BAD_JSON = re.compile(rb"\\u(?:0000|[dD][89a-fA-F][0-9a-fA-F]{2})")
BAD_TEXT = re.compile("[\x00\ud800-\udfff]")
SURROGATE = re.compile("[\ud800-\udfff]")
NUL_DETAIL = "must not contain the NUL character (\\u0000)"
SURROGATE_DETAIL = "must not contain a lone surrogate (\\ud800-\\udfff): it is not Unicode"
Path = list[str | int]


def _detail(text: str) -> str:
    return NUL_DETAIL if "\x00" in text else SURROGATE_DETAIL


def bad_json_text(document: Any) -> tuple[Path, str] | None:
    """The path of a string or key in ``document`` that holds a NUL or a lone surrogate (a
    key names itself), and what is wrong with it; None if there is none.

    Iterative: a document nested as deep as the JSON parser allows is walked without
    recursion."""
    pending: list[tuple[Path, Any]] = [([], document)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            if BAD_TEXT.search(value):
                return path, _detail(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                if BAD_TEXT.search(key):
                    return [*path, key], _detail(key)
                pending.append(([*path, key], item))
        elif isinstance(value, list):
            pending.extend(([*path, index], item) for index, item in enumerate(value))
    return None


def _bad_json_body(body: bytes) -> tuple[Path, str] | None:
    if not MAYBE_BAD_JSON.search(body):
        return None
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None  # not JSON: the route refuses it as such
    return bad_json_text(document)


def _bad_form_body(body: bytes) -> tuple[Path, str] | None:
    if b"%00" not in body and b"\x00" not in body:
        return None
    for name, value in parse_qsl(body.decode("latin-1"), keep_blank_values=True):
        if "\x00" in name or "\x00" in value:
            return [name], NUL_DETAIL
    return None


def _kind(scope: Scope) -> str | None:
    """Which parser reads this request's body: "json" (FastAPI reads a body without a
    content type as JSON too), "form", or None."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            if media == b"application/x-www-form-urlencoded":
                return "form"
            return "json" if media.endswith((b"/json", b"+json")) else None
    return "json"


def _readable(text: str) -> str:
    # A lone surrogate cannot be encoded in the answer either: it is named by U+FFFD.
    return SURROGATE.sub("\ufffd", text)


class BodyTextMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = _kind(scope) if scope["type"] == "http" and scope["method"] in BODY_METHODS else None
        if kind is None:
            await self.app(scope, receive, send)
            return
        body, last = await _read_body(receive)
        if last is not None:
            return  # the client went away (or its body was late): there is no one to answer
        found = _bad_json_body(body) if kind == "json" else _bad_form_body(body)
        if found is not None:
            await self._refuse(found, scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: a disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(
        self, found: tuple[Path, str], scope: Scope, receive: Receive, send: Send
    ) -> None:
        path, reason = found
        field, pointer = field_name(path)
        field = _readable(field)
        errors = [{"field": field, "pointer": _readable(pointer), "detail": reason}]
        answer = problem(422, f"{field}: {reason}", slug="validation-error", errors=errors)
        await answer(scope, receive, send)


async def _read_body(receive: Receive) -> tuple[bytes, Message | None]:
    """The whole body, and None; or what was read and the message that ended it early (a
    disconnect)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), message
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), None
