"""An MCP tool's answer as Ratchet keeps it."""

from __future__ import annotations

import mcp_types as types
import pytest

from shared.errors import ToolError
from shared.mcp.results import tool_result


def result(*content: types.ContentBlock, **extra: object) -> types.CallToolResult:
    return types.CallToolResult(content=list(content), **extra)  # type: ignore[arg-type]


def text(value: str) -> types.TextContent:
    return types.TextContent(type="text", text=value)


def test_structured_content_wins() -> None:
    answer = result(text('{"n": 1}'), structured_content={"n": 1})
    assert tool_result(answer) == {"n": 1}


def test_text_blocks_are_joined() -> None:
    assert tool_result(result(text("one"), text("two"))) == "one\ntwo"
    assert tool_result(result()) == ""


def test_images_audio_and_resources_are_entries() -> None:
    image = types.ImageContent(type="image", data="aGk=", mime_type="image/png")
    audio = types.AudioContent(type="audio", data="aGk=", mime_type="audio/wav")
    link = types.ResourceLink(type="resource_link", uri="file:///a.txt", name="a")
    embedded = types.EmbeddedResource(
        type="resource",
        resource=types.TextResourceContents(uri="file:///b.txt", text="b", mime_type="text/plain"),
    )
    assert tool_result(result(text("see"), image, audio, link, embedded)) == [
        {"type": "text", "text": "see"},
        {"type": "image", "mime_type": "image/png", "data": "aGk="},
        {"type": "audio", "mime_type": "audio/wav", "data": "aGk="},
        {"type": "resource_link", "uri": "file:///a.txt", "name": "a"},
        {"type": "resource", "uri": "file:///b.txt", "mime_type": "text/plain", "text": "b"},
    ]


@pytest.mark.parametrize(
    ("content", "message"), [((text("no such repo"),), "no such repo"), ((), "reported an error")]
)
def test_is_error_is_a_tool_error_with_the_servers_text(
    content: tuple[types.ContentBlock, ...], message: str
) -> None:
    with pytest.raises(ToolError, match=message):
        tool_result(result(*content, is_error=True, structured_content={"ignored": True}))
