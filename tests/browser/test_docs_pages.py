"""The API's pages in a real browser load nothing from another host: the docs pages (Swagger
UI, ReDoc) and the dashboard's login work offline, and nothing a page asks for is a 404 — the
favicon the browser asks for included."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from playwright.sync_api import Page, expect

from tests.e2e.conftest import Stack

# What each page shows once its script has rendered it (ReDoc's footer is where its logo loads).
RENDERED = {
    "/docs": ".swagger-ui .info .title",
    "/redoc": "text=API docs by Redocly",
    "/dashboard/login": "#key",
}


@pytest.mark.parametrize("path", list(RENDERED))
def test_a_page_loads_everything_from_the_api(
    open_page: Callable[..., Page], stack: Stack, path: str
) -> None:
    page = open_page()
    requested: list[str] = []
    failed: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.on(
        "response",
        lambda response: (
            failed.append(f"{response.status} {response.url}") if response.status >= 400 else None
        ),
    )

    page.goto(path)
    expect(page.locator(RENDERED[path]).first).to_be_visible()
    page.wait_for_load_state("networkidle")
    favicon = page.request.get("/favicon.ico")

    outside = [url for url in requested if not url.startswith((stack.url, "data:", "blob:"))]
    assert outside == [], outside
    assert failed == [], failed
    assert favicon.status == 200
