"""What an MCP tool's answer becomes: the result the ledger keeps and the model reads, or a
tool error."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import mcp_types as types

from shared.errors import ToolError


def tool_result(result: types.CallToolResult) -> Any:
    """The tool's result as Ratchet keeps it: its ``structuredContent`` if it gave one, else its
    text (the text blocks joined), else a list of entries, images and audio as
    ``{"type": "image", "mime_type": …, "data": <base64>}``. A result the server marks
    ``isError`` is a ToolError carrying its text: the model reads it."""
    if result.is_error:
        text = "\n".join(_texts(result.content)) or "the tool reported an error"
        raise ToolError(text)
    if result.structured_content is not None:
        return result.structured_content
    entries = [_entry(block) for block in result.content]
    if all(entry.get("type") == "text" for entry in entries):
        return "\n".join(str(entry["text"]) for entry in entries)
    return entries


def _texts(content: Iterable[types.ContentBlock]) -> list[str]:
    return [block.text for block in content if isinstance(block, types.TextContent)]


def _entry(block: types.ContentBlock) -> dict[str, Any]:
    if isinstance(block, types.TextContent):
        return {"type": "text", "text": block.text}
    if isinstance(block, types.ImageContent | types.AudioContent):
        return {"type": block.type, "mime_type": block.mime_type, "data": block.data}
    if isinstance(block, types.ResourceLink):
        return {"type": "resource_link", "uri": str(block.uri), "name": block.name}
    if isinstance(block, types.EmbeddedResource):
        inner = block.resource
        entry: dict[str, Any] = {"type": "resource", "uri": str(inner.uri)}
        if inner.mime_type:
            entry["mime_type"] = inner.mime_type
        if isinstance(inner, types.TextResourceContents):
            entry["text"] = inner.text
        else:
            entry["data"] = inner.blob
        return entry
    return {"type": getattr(block, "type", "unknown")}
