"""What every command prints: one-line errors on stderr, JSON documents on stdout; and the
HTTP client of the commands that talk to a server."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

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
    return Client(os.environ.get("RATCHET_URL", DEFAULT_URL), key, timeout=75)
