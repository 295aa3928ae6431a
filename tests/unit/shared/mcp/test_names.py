"""MCP tool names: ``<server>.<tool>`` and ``<server>.*``."""

from __future__ import annotations

import pytest

from shared.mcp.names import covers, is_mcp_name, server_of, split


@pytest.mark.parametrize(
    ("name", "parts"),
    [
        ("github.create_issue", ("github", "create_issue")),
        ("files.*", ("files", "*")),
        ("a-b_1.tool.with.dots", ("a-b_1", "tool.with.dots")),
        ("calculator", None),
        ("GitHub.create", None),  # not a server name
        (".tool", None),
        ("server.", None),
    ],
)
def test_split(name: str, parts: tuple[str, str] | None) -> None:
    assert split(name) == parts
    assert is_mcp_name(name) is (parts is not None)
    assert server_of(name) == (parts[0] if parts else None)


def test_a_list_covers_a_tool_by_name_or_by_its_servers_wildcard() -> None:
    assert covers(["files.*"], "files.read")
    assert covers(["files.read"], "files.read")
    assert not covers(["files.read"], "files.write")
    assert not covers(["web.*"], "files.read")
    assert covers(["calculator"], "calculator")
    assert not covers(["*"], "calculator")
