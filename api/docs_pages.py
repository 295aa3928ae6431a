"""The API's ReDoc page (``/redoc``) with everything it shows served by the API itself.

``fastapi_offline`` serves Swagger UI (``/docs``) and ReDoc from the package instead of a CDN,
but the ReDoc bundle's sidebar footer still loads Redocly's logo from ``cdn.redoc.ly``: offline
the page waits on it, and every visit tells a third party who reads the docs. The bundle is
served here with that one address pointed at a logo the API serves.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html
from fastapi.responses import HTMLResponse, Response

BUNDLED = Path(fastapi_offline.__file__).parent / "static" / "redoc.standalone.js"
REDOC_LOGO = b"https://cdn.redoc.ly/redoc/logo-mini.svg"
PATH = "/redoc"
# A plain mark beside the footer's "API docs by Redocly" (the bundle hides a logo that fails).
LOGO = (
    b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16" width="16" height="16">'
    b'<rect x="2" y="1" width="12" height="14" rx="2" fill="#8a8fa3"/>'
    b'<path d="M5 5h6M5 8h6M5 11h4" stroke="#fff" stroke-width="1.5"/></svg>'
)
CACHED = {"Cache-Control": "public, max-age=86400"}


@cache
def redoc_bundle() -> bytes:
    """The packaged ReDoc bundle, its logo's address made this API's own."""
    bundle = BUNDLED.read_bytes()
    return bundle.replace(REDOC_LOGO, f"{PATH}/logo-mini.svg".encode())


async def _page(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_redoc_html(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=f"{root}{PATH}/redoc.standalone.js",
        redoc_favicon_url=f"{root}/favicon.ico",
        with_google_fonts=False,
    )


async def _bundle() -> Response:
    return Response(redoc_bundle(), media_type="text/javascript", headers=CACHED)


async def _logo() -> Response:
    return Response(LOGO, media_type="image/svg+xml", headers=CACHED)


def install(app: FastAPI) -> None:
    """Serve ``/redoc`` and its assets (the app is made with ``redoc_url=None``)."""
    app.add_api_route(PATH, _page, include_in_schema=False)
    app.add_api_route(f"{PATH}/redoc.standalone.js", _bundle, include_in_schema=False)
    app.add_api_route(f"{PATH}/logo-mini.svg", _logo, include_in_schema=False)
