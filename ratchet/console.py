"""What every command prints: one-line errors on stderr, JSON documents on stdout; and the
HTTP client of the commands that talk to a server."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import typer

if TYPE_CHECKING:
    from ratchet.client import Client

DEFAULT_URL = "http://127.0.0.1:8000"


def err(message: str) -> None:
    typer.echo(message, err=True)


def fail(message: str, code: int = 2) -> typer.Exit:
    err(f"error: {message}")
    return typer.Exit(code)


def print_json(document: Any) -> None:
    typer.echo(json.dumps(document, indent=2))


def api_client() -> Client:
    """A client for RATCHET_URL with RATCHET_KEY."""
    from ratchet.client import Client

    key = os.environ.get("RATCHET_KEY")
    if not key:
        raise fail(f"set RATCHET_KEY to an API key (and RATCHET_URL if not {DEFAULT_URL})")
    return Client(api_url(), key, timeout=75)


def api_url() -> str:
    """RATCHET_URL, refused in one line unless it is an http(s) URL with a host. A URL
    without its scheme is not guessed at: http:// would send the key in the clear to a
    server that wanted https://."""
    url = os.environ.get("RATCHET_URL") or DEFAULT_URL
    try:
        parts = urlsplit(url)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:  # a bad port, or an unclosed bracket
        usable = False
    if not usable:
        raise fail(
            f"RATCHET_URL {url!r} is not an http(s) URL: write it with its scheme, e.g. "
            f"http://{url.split('://')[-1].strip('/') or '127.0.0.1:8000'}"
        )
    return url
