"""Credentials in a URL: refused, and kept out of the access log.

A key in a query string ends up in access logs, proxies' logs and browser history, so a
request carrying ``api_key``, ``apikey``, ``key``, ``token`` or ``access_token`` there, or
anything shaped like an API key (``rk_…``, as a name or as any parameter's value), is refused
with a 400 whatever its path, before any route sees it. Its query string is also replaced in
the ASGI scope, which is what uvicorn's access log line is built from, so the key is not
logged.
"""

from __future__ import annotations

import json
import re
from urllib.parse import parse_qsl, urlencode

from starlette.types import ASGIApp, Receive, Scope, Send

NAMES = frozenset({"api_key", "apikey", "api-key", "key", "token", "access_token"})
# An API key's shape (``shared.store.tenants.KEY_FORMAT``), loosely: a cut or padded key is
# still most of a secret. Not preceded by a word character, so ``network_…`` is no key.
KEY_SHAPED = re.compile(r"(?<![A-Za-z0-9_-])rk_[A-Za-z0-9_-]{16,}", re.ASCII)
REDACTED = "REDACTED"
DETAIL = "send the API key in the 'Authorization: Bearer <key>' header, never in the URL"


def redacted(query: bytes) -> bytes | None:
    """The query string with credential values replaced, or None if it carries none."""
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    if not any(_credential(name, value) for name, value in pairs):
        return None
    safe = [(KEY_SHAPED.sub(REDACTED, n), REDACTED if _credential(n, v) else v) for n, v in pairs]
    return urlencode(safe).encode("latin-1")


def _credential(name: str, value: str) -> bool:
    """A parameter that carries a key: by its name, or a name or value shaped like one."""
    return name.lower() in NAMES or bool(KEY_SHAPED.search(name) or KEY_SHAPED.search(value))


class UrlCredentialsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = scope.get("query_string", b"") if scope["type"] == "http" else b""
        clean = redacted(query) if query else None
        if clean is None:
            await self.app(scope, receive, send)
            return
        scope["query_string"] = clean  # the access log reads the path from this very scope
        await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {
                "type": "urn:ratchet:problem:credentials-in-url",
                "title": "Bad Request",
                "status": 400,
                "detail": DETAIL,
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 400,
                "headers": [
                    (b"content-type", b"application/problem+json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
