"""The tools both test servers serve, and the files they record to.

``MCP_FAKE_DIR/starts``: one line per server start (its pid). ``MCP_FAKE_DIR/calls``: one
JSON line per call, written before the tool acts: ``{"tool", "arguments", "key", "pid",
"authorization"}``, ``key`` being the ``ratchet/idempotency_key`` of the call's ``_meta`` and
``authorization`` the request's header (HTTP only). The slow tools end early once the file
``MCP_FAKE_DIR/release`` exists.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ImageContent, ToolAnnotations

META_KEY = "ratchet/idempotency_key"
PIXEL = "iVBORw0KGgo="  # a few bytes of base64, as an image's data


@dataclass(frozen=True)
class Record:
    """What a test server wrote to ``directory``."""

    directory: Path

    def starts(self) -> list[int]:
        return [int(line) for line in self._lines("starts")]

    def calls(self, tool: str | None = None) -> list[dict[str, Any]]:
        calls = [json.loads(line) for line in self._lines("calls")]
        return [c for c in calls if tool is None or c["tool"] == tool]

    def _lines(self, name: str) -> list[str]:
        try:
            return (self.directory / name).read_text().splitlines()
        except FileNotFoundError:
            return []


def _append(name: str, line: str) -> None:
    directory = os.environ.get("MCP_FAKE_DIR")
    if directory:
        with (Path(directory) / name).open("a") as out:
            out.write(line + "\n")
            out.flush()


def _record(tool: str, arguments: dict[str, Any], ctx: Context) -> None:
    meta = ctx.request_context.meta or {}
    key = dict(meta).get(META_KEY)
    # Over HTTP, the request's Authorization header (what the client was configured to send).
    request = getattr(ctx.request_context, "request", None)
    headers = getattr(request, "headers", None)
    authorization = headers.get("authorization") if headers is not None else None
    entry = {
        "tool": tool,
        "arguments": arguments,
        "key": key,
        "pid": os.getpid(),
        "authorization": authorization,
    }
    _append("calls", json.dumps(entry))


async def _hold(seconds: float) -> None:
    """Sleep ``seconds``, or less once the file ``MCP_FAKE_DIR/release`` exists."""
    release = Path(os.environ.get("MCP_FAKE_DIR") or ".") / "release"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline and not release.exists():
        await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))


def build(name: str) -> MCPServer:
    """A server named ``name`` with the test tools; its start is recorded."""
    server = MCPServer(name, log_level="CRITICAL")  # its errors are the tests' to read
    _append("starts", str(os.getpid()))

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def add(a: int, b: int, ctx: Context) -> int:
        """Add two integers."""
        _record("add", {"a": a, "b": b}, ctx)
        return a + b

    @server.tool(structured_output=False)
    def echo(text: str, ctx: Context) -> str:
        """Say the text back, as plain text."""
        _record("echo", {"text": text}, ctx)
        return text

    @server.tool(annotations=ToolAnnotations(destructiveHint=True))
    def delete_file(path: str, ctx: Context) -> str:
        """Delete a file (it says so; it deletes nothing)."""
        _record("delete_file", {"path": path}, ctx)
        return f"deleted {path}"

    @server.tool(annotations=ToolAnnotations(idempotentHint=True))
    def upsert(key: str, ctx: Context) -> dict[str, str]:
        """Set a key (twice is the same as once)."""
        _record("upsert", {"key": key}, ctx)
        return {"upserted": key}

    @server.tool()
    async def slow_write(seconds: float, ctx: Context) -> str:
        """A side effect that takes its time."""
        _record("slow_write", {"seconds": seconds}, ctx)
        await _hold(seconds)
        return "written"

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True))
    async def slow_read(seconds: float, ctx: Context) -> str:
        """A read that takes its time."""
        _record("slow_read", {"seconds": seconds}, ctx)
        await _hold(seconds)
        return "read"

    @server.tool()
    def fail(ctx: Context) -> str:
        """Always fails."""
        _record("fail", {}, ctx)
        raise ToolError("the tool failed on purpose")

    @server.tool()
    def crash(ctx: Context) -> str:
        """The server dies mid-call."""
        _record("crash", {}, ctx)
        os._exit(17)

    @server.tool()
    def picture(ctx: Context) -> ImageContent:
        """A tiny image."""
        _record("picture", {}, ctx)
        return ImageContent(type="image", data=PIXEL, mime_type="image/png")

    @server.tool()
    async def grow(tool: str, ctx: Context) -> str:
        """Add a tool named ``tool`` and tell the client its tools changed."""
        _record("grow", {"tool": tool}, ctx)
        server.add_tool(lambda: f"{tool} ran", name=tool, description=f"added by grow: {tool}")
        await ctx.session.send_tool_list_changed()
        return f"added {tool}"

    return server
