"""The ops dashboard at ``/dashboard``: server-rendered pages (Jinja2) over the same stores
as the JSON API, a session cookie instead of a bearer key, and a little plain JavaScript for
the live parts. Its styles and script are served from the package: it works offline."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from api.dashboard import (
    admin_pages,
    approval_pages,
    auth,
    link_pages,
    pages,
    task_pages,
    thread_pages,
)
from api.dashboard.flash import FlashSigning
from api.dashboard.render import HERE


def install(app: FastAPI) -> None:
    app.mount("/dashboard/static", StaticFiles(directory=HERE / "static"), name="dashboard-static")
    for module in (auth, pages, task_pages, thread_pages, admin_pages, approval_pages):
        app.include_router(module.router)
    app.include_router(link_pages.router)  # pages without a key: the link is the credential
    app.add_exception_handler(auth.LoginRequired, auth.login_redirect)
    app.add_exception_handler(auth.Forbidden, auth.forbidden)
    app.add_middleware(FlashSigning)  # a page shows only a flash its own form's answer signed
