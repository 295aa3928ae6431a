"""Declaring MCP servers: every bad declaration is one line naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from shared.mcp.config import declared, parse_file, parse_inline
from shared.settings import Settings, describe_invalid

STDIO = {"command": "python", "args": ["-m", "files_server"], "env": {"ROOT": "/srv"}}
HTTP = {"url": "https://mcp.example.com/mcp", "headers": {"Authorization": "Bearer x"}}


def test_a_stdio_and_an_http_server_with_their_options() -> None:
    servers = parse_inline(
        json.dumps(
            {
                "files": STDIO,
                "git-hub_2": HTTP
                | {
                    "timeout_seconds": 5,
                    "agents": ["support"],
                    "on_unknown_outcome": "fail",
                    "tools": {"create_issue": {"requires_approval": False, "idempotent": True}},
                },
            }
        )
    )
    files, github = servers["files"], servers["git-hub_2"]
    assert (files.transport, files.args) == ("stdio", ("-m", "files_server"))
    assert files.env == {"ROOT": "/srv"}
    assert (files.timeout_seconds, files.agents) == (30, None)
    assert files.on_unknown_outcome == "tell_model"
    assert files.allows("anyone")
    assert github.transport == "http"
    assert github.allows("support")
    assert not github.allows("default")
    override = github.tools["create_issue"]
    assert (override.idempotent, override.requires_approval, override.on_unknown_outcome) == (
        True,
        False,
        None,
    )


def test_secrets_stay_out_of_the_repr() -> None:
    servers = parse_inline(json.dumps({"web": HTTP, "files": STDIO}))
    assert "Bearer" not in repr(servers["web"])
    assert "/srv" not in repr(servers["files"])


@pytest.mark.parametrize(
    ("declaration", "message"),
    [
        ({"Files": STDIO}, "server name 'Files' must match [a-z0-9_-]+"),
        ({"a.b": STDIO}, "server name 'a.b' must match"),
        ({"files": {}}, "files: give either command (stdio) or url (Streamable HTTP)"),
        ({"files": STDIO | HTTP}, "give either command (stdio) or url"),
        ({"web": HTTP | {"args": ["x"]}}, "args, env and cwd are for a stdio server"),
        ({"files": STDIO | {"headers": {"a": "b"}}}, "headers are for a Streamable HTTP server"),
        ({"web": {"url": "ftp://example.com"}}, "web.url: not an http(s) URL with a host"),
        ({"web": HTTP | {"timeout_seconds": 0}}, "web.timeout_seconds: Input should be greater"),
        ({"web": HTTP | {"tools": {"t": {"idempotent": "maybe"}}}}, "web.tools.t.idempotent"),
        ({"web": HTTP | {"tools": {"t": {"retries": 3}}}}, "web.tools.t.retries: Extra inputs"),
        ({"web": HTTP | {"on_unknown_outcome": "retry"}}, "web.on_unknown_outcome"),
        ([HTTP], "Input should be an object"),
    ],
)
def test_a_bad_declaration_says_what_is_wrong(declaration: object, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_inline(json.dumps(declaration))
    assert message in str(caught.value)
    assert "Value error" not in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_file_and_the_setting_merge_and_the_setting_wins(tmp_path: Path) -> None:
    file = tmp_path / "mcp.json"
    file.write_text(json.dumps({"files": STDIO, "web": HTTP}))
    servers = declared(json.dumps({"web": HTTP | {"timeout_seconds": 3}}), file)
    assert sorted(servers) == ["files", "web"]
    assert servers["web"].timeout_seconds == 3
    assert declared("", None) == {}


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "no such file"), ("{not json", "is not valid JSON"), ('{"X": {}}', "server name 'X'")],
)
def test_a_bad_file_says_what_is_wrong(tmp_path: Path, content: str | None, message: str) -> None:
    file = tmp_path / "mcp.json"
    if content is not None:
        file.write_text(content)
    with pytest.raises(ValueError) as caught:
        parse_file(file)
    assert str(file) in str(caught.value)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("env", "line"),
    [
        ({"RATCHET_MCP_SERVERS": '{"files": {}}'}, "RATCHET_MCP_SERVERS: files: give either"),
        ({"RATCHET_MCP_SERVERS_FILE": "/nowhere/mcp.json"}, "RATCHET_MCP_SERVERS_FILE: no such"),
        ({"RATCHET_MCP_TOOLS_TTL_SECONDS": "0"}, "RATCHET_MCP_TOOLS_TTL_SECONDS: Input should be"),
    ],
)
def test_bad_settings_stop_the_process_with_one_line(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], line: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as caught:
        Settings()
    described = describe_invalid(caught.value)
    assert described.startswith(line)
    assert "\n" not in described
