"""Flash messages: the one line a dashboard page shows after a form of it did something.

A flash travels in the query string of the redirect that answers the form (``?flash=…``),
so a link made by anyone could put any text in that banner, on this site, in its style
("Your session expired: call …"). A flash is therefore shown only with its signature,
``flash_sig``: an HMAC of its text keyed by the viewer's own session cookie, which
:class:`FlashSigning` adds to the redirects the dashboard answers its forms with, and checks
on the page that follows. A link made by someone else carries no signature valid for the
viewer's session: its flash is taken out of the request before any page reads it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from starlette.datastructures import MutableHeaders
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.dashboard.auth import COOKIE, PATH

SIG = "flash_sig"
# A login's redirect goes to the ``next`` its form was given, which a link chooses.
UNSIGNED = frozenset({f"{PATH}/login"})


def signature(session: str, text: str) -> str:
    digest = hmac.new(session.encode(), text.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest[:16]).decode().rstrip("=")


def unsigned_removed(query: bytes, session: str | None) -> bytes | None:
    """``query`` without its flash (and signature) if the flash is not signed for
    ``session``; None when it may stay as it is."""
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    texts = [v for k, v in pairs if k == "flash"]
    if not texts:
        return None
    given = [v for k, v in pairs if k == SIG]
    expected = signature(session, texts[-1]) if session else ""
    if session and given and hmac.compare_digest(given[-1], expected):
        return None
    return urlencode([(k, v) for k, v in pairs if k not in ("flash", SIG)]).encode("latin-1")


def signed_location(location: str, session: str) -> str:
    """``location`` with a signature for its flash, if it carries one."""
    parts = urlsplit(location)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != SIG]
    texts = [v for k, v in query if k == "flash"]
    if not texts:
        return location
    query.append((SIG, signature(session, texts[-1])))  # the value a page reads is the last
    return urlunsplit(parts._replace(query=urlencode(query)))


class FlashSigning:
    """Signs the flash of a redirect that answers a dashboard form (a POST, which the
    dashboard accepts only with the session's CSRF token and from this origin), and drops
    an unsigned flash from any other dashboard request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith(PATH):
            await self.app(scope, receive, send)
            return
        session = HTTPConnection(scope).cookies.get(COOKIE)
        query = scope.get("query_string", b"")
        cleaned = unsigned_removed(query, session) if b"flash" in query else None
        if cleaned is not None:
            scope = {**scope, "query_string": cleaned}
        if scope["method"] != "POST" or path in UNSIGNED or not session:
            await self.app(scope, receive, send)
            return

        async def signing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and 300 <= message["status"] < 400:
                headers = MutableHeaders(scope=message)
                if "location" in headers:
                    headers["location"] = signed_location(headers["location"], session)
            await send(message)

        await self.app(scope, receive, signing_send)
