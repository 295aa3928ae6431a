"""Headers that keep a browser from misreading a response or framing a page.

Every response says ``X-Content-Type-Options: nosniff``: a JSON answer that echoes a client's
text is never run as a script or styled as a page. An HTML page (the dashboard, an approval
link's page, the API docs) also refuses to be framed by any site (``X-Frame-Options: DENY``
and CSP ``frame-ancestors 'none'``), so no other site can overlay its buttons (clickjacking),
and sends no ``Referer`` to other sites (an approval link's URL is its credential).
A header a route set itself is kept.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

EVERY_RESPONSE = {"x-content-type-options": "nosniff"}
HTML_PAGES = {
    "x-frame-options": "DENY",
    "content-security-policy": "frame-ancestors 'none'",
    "referrer-policy": "same-origin",
}


class SecurityHeadersMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                html = headers.get("content-type", "").startswith("text/html")
                for name, value in (EVERY_RESPONSE | (HTML_PAGES if html else {})).items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers)
