"""Rendering the dashboard's pages: one Jinja2 environment, autoescaped, with the filters
the templates share. Times go out as ``<time datetime=…>`` in UTC; the page's script shows
them in the viewer's zone."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from markupsafe import Markup, escape

from shared.mcp.names import server_of
from shared.ops.sessions import Login
from shared.views import aware

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")


def _time(value: datetime | None) -> Markup:
    stamp = aware(value)
    if stamp is None:
        return Markup("<span class=muted>—</span>")
    iso = stamp.isoformat(timespec="seconds")
    return Markup(
        f'<time datetime="{iso}">{escape(stamp.strftime("%Y-%m-%d %H:%M:%S"))} UTC</time>'
    )


def _number(value: float | int | None) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.1f}"
    return f"{int(value):,}"


def _money(value: float | None) -> str:
    return "—" if value is None else f"${value:,.4f}"


def _query(params: dict[str, Any], **changes: Any) -> str:
    """``params`` with ``changes`` applied (None removes a key), as a query string."""
    merged = {k: v for k, v in {**params, **changes}.items() if v not in (None, "")}
    return "?" + urlencode(merged) if merged else "?"


def _epoch(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


templates.env.filters.update(time=_time, number=_number, money=_money, epoch=_epoch)
templates.env.filters.update(mcp_server=server_of)  # the MCP server of a `<server>.<tool>`
templates.env.globals.update(query=_query)


def page(
    request: Request, name: str, login: Login | None, *, status: int = 200, **context: Any
) -> HTMLResponse:
    """A whole page; ``login`` is None only on the login page."""
    return templates.TemplateResponse(
        request,
        name,
        {"login": login, "flash": request.query_params.get("flash"), **context},
        status_code=status,
        headers={"Cache-Control": "no-store"},
    )
