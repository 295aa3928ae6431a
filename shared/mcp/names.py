"""The names of MCP tools, ``<server>.<tool>`` (``<server>.*``: all of a server's tools), read
without loading the MCP SDK: the registry, the API's schemas and the dashboard ask."""

from __future__ import annotations

import re
from collections.abc import Iterable

NAME_PATTERN = r"[a-z0-9_-]+"
WILDCARD = "*"
_SERVER = re.compile(rf"^{NAME_PATTERN}$")


def split(name: str) -> tuple[str, str] | None:
    """``(server, tool)`` for an MCP tool's name (``tool`` may be ``*``), else None."""
    server, dot, tool = name.partition(".")
    if not dot or not tool or not _SERVER.match(server):
        return None
    return server, tool


def is_mcp_name(name: str) -> bool:
    return split(name) is not None


def server_of(name: str) -> str | None:
    """The MCP server a tool name belongs to (None for a Python tool)."""
    found = split(name)
    return None if found is None else found[0]


def covers(names: Iterable[str], name: str) -> bool:
    """Whether the tool list ``names`` includes ``name``, by name or by its server's ``*``."""
    found = split(name)
    listed = set(names)
    return name in listed or (found is not None and f"{found[0]}.{WILDCARD}" in listed)
