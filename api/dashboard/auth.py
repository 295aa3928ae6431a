"""Logging in to the dashboard: an API key with the ``admin`` or ``operator`` scope, posted
once on the login page, is exchanged for a server-side session held in an HttpOnly,
SameSite=Strict cookie (Secure over https). Every form that changes something carries the
session's CSRF token, and every POST must come from the dashboard's own origin."""

from __future__ import annotations

import secrets
from typing import Annotated
from urllib.parse import quote, urlsplit

from fastapi import APIRouter, Depends, Form, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from api.dashboard.render import page
from shared.errors import KeyRejected
from shared.ops import sessions
from shared.ops.sessions import Login
from shared.store.db import get_sessionmaker, transaction

COOKIE = "ratchet_session"
PATH = "/dashboard"
router = APIRouter(prefix=PATH, include_in_schema=False)


class LoginRequired(Exception):
    """No live session: the browser is sent to the login page."""

    def __init__(self, next_url: str) -> None:
        self.next_url = next_url


class Forbidden(Exception):
    """A request the session may not make (a missing CSRF token, a foreign origin, or an
    operator's page opened by a tenant admin)."""


def _resume(cookie: str) -> Login | None:
    with get_sessionmaker()() as session, session.begin():
        return sessions.resume(session, cookie)


async def current_login(request: Request) -> Login:
    cookie = request.cookies.get(COOKIE)
    login = await run_in_threadpool(_resume, cookie) if cookie else None
    if login is None:
        raise LoginRequired(
            request.url.path + (f"?{request.url.query}" if request.url.query else "")
        )
    return login


async def checked_login(request: Request, login: Annotated[Login, Depends(current_login)]) -> Login:
    """The session of a POST that changes something: from this origin, with its CSRF token."""
    same_origin(request)
    form = await request.form()
    token = form.get("csrf_token")
    if not isinstance(token, str) or not secrets.compare_digest(token, login.csrf_token):
        raise Forbidden("this form has no valid CSRF token: reload the page and try again")
    return login


async def operator_login(login: Annotated[Login, Depends(current_login)]) -> Login:
    if not login.operator:
        raise Forbidden("this page is for operators: it shows the whole fleet")
    return login


def same_origin(request: Request) -> None:
    origin = request.headers.get("origin") or request.headers.get("referer")
    if origin is not None and urlsplit(origin).netloc != request.url.netloc:
        raise Forbidden("this request came from another site")


CurrentLogin = Annotated[Login, Depends(current_login)]
CheckedLogin = Annotated[Login, Depends(checked_login)]
OperatorLogin = Annotated[Login, Depends(operator_login)]


def _safe_next(next_url: str | None) -> str:
    """Only a path inside the dashboard: a login link cannot send the browser elsewhere."""
    if next_url and next_url.startswith(PATH) and not next_url.startswith("//"):
        return next_url
    return PATH


@router.get("/login", response_class=HTMLResponse)
async def login_page(request: Request, next: str | None = None) -> Response:
    return page(request, "login.html", None, next=_safe_next(next), error=None)


def _open(key: str) -> tuple[str, Login]:
    with transaction() as session:
        return sessions.open_session(session, key)


@router.post("/login", response_class=HTMLResponse)
async def login(
    request: Request,
    key: Annotated[str, Form(max_length=200)],
    next: Annotated[str | None, Form()] = None,
) -> Response:
    same_origin(request)
    try:
        cookie, _ = await run_in_threadpool(_open, key.strip())
    except KeyRejected as exc:
        return page(request, "login.html", None, next=_safe_next(next), error=str(exc), status=401)
    response = RedirectResponse(_safe_next(next), status_code=303)
    response.set_cookie(
        COOKIE,
        cookie,
        max_age=int(sessions.LIFETIME.total_seconds()),
        path=PATH,
        httponly=True,
        secure=request.url.scheme == "https",
        samesite="strict",
    )
    return response


def _close(cookie: str) -> None:
    with transaction() as session:
        sessions.close(session, cookie)


@router.post("/logout")
async def logout(request: Request, _: CheckedLogin) -> Response:
    await run_in_threadpool(_close, request.cookies[COOKIE])
    response = RedirectResponse(f"{PATH}/login", status_code=303)
    response.delete_cookie(COOKIE, path=PATH, httponly=True, samesite="strict")
    return response


def login_redirect(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, LoginRequired)
    return RedirectResponse(f"{PATH}/login?next={quote(exc.next_url)}", status_code=303)


def forbidden(request: Request, exc: Exception) -> Response:
    return page(request, "error.html", None, status=403, message=str(exc))
