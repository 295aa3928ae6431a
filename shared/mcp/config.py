"""The MCP servers an operator declares: ``RATCHET_MCP_SERVERS`` (JSON, by server name) and
``RATCHET_MCP_SERVERS_FILE`` (the same JSON in a file; the setting wins for a name in both).

A server is a command to start as a child of each process that uses it (stdio: ``command``,
``args``, ``env``, ``cwd``) or the URL of a Streamable HTTP endpoint (``url``, ``headers``).
Either may set ``timeout_seconds`` (each call, and starting the server), ``agents`` (which
agents may use it; all by default), ``on_unknown_outcome`` (the policy for its non-idempotent
tools when a call's outcome is unknown) and per-tool ``tools`` overrides, which win over what
the server's annotations say.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from shared.configfile import first_error, read_json
from shared.mcp.names import NAME_PATTERN

ServerName = Annotated[str, StringConstraints(pattern=rf"^{NAME_PATTERN}$", max_length=64)]
UnknownOutcomePolicy = Literal["fail", "tell_model", "ask"]
DEFAULT_TIMEOUT_SECONDS = 30.0


class ToolOverride(BaseModel):
    """What the operator says about one tool, over the server's annotations."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    idempotent: bool | None = None
    requires_approval: bool | None = None
    on_unknown_outcome: UnknownOutcomePolicy | None = None


class ServerConfig(BaseModel):
    """One declared MCP server: stdio (``command``) or Streamable HTTP (``url``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: str | None = Field(None, min_length=1)
    args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict, repr=False)  # may hold secrets
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = Field(default_factory=dict, repr=False)  # may hold secrets
    timeout_seconds: float = Field(DEFAULT_TIMEOUT_SECONDS, gt=0, le=3600)
    tools: dict[str, ToolOverride] = Field(default_factory=dict)
    agents: tuple[str, ...] | None = None
    on_unknown_outcome: UnknownOutcomePolicy = "tell_model"

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL with a host: {value!r}")
        return value

    @model_validator(mode="after")
    def _one_transport(self) -> ServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("give either command (stdio) or url (Streamable HTTP)")
        if self.url is not None and (self.args or self.env or self.cwd):
            raise ValueError("args, env and cwd are for a stdio server (command)")
        if self.command is not None and self.headers:
            raise ValueError("headers are for a Streamable HTTP server (url)")
        return self

    @property
    def transport(self) -> Literal["stdio", "http"]:
        return "stdio" if self.command is not None else "http"

    def allows(self, agent: str) -> bool:
        """Whether tasks of ``agent`` may use this server's tools."""
        return self.agents is None or agent in self.agents

    # Hashable (a session is kept per name and configuration): dicts are compared by value.
    def __hash__(self) -> int:
        return hash(self.model_dump_json())


Servers = dict[ServerName, ServerConfig]
_servers = TypeAdapter(Servers)


def parse_inline(text: str) -> dict[str, ServerConfig]:
    """``RATCHET_MCP_SERVERS``: ValueError with one line naming what is wrong."""
    if not text.strip():
        return {}
    try:
        return _servers.validate_json(text)
    except ValidationError as exc:
        raise ValueError(_describe(exc)) from None


def parse_file(file: Path) -> dict[str, ServerConfig]:
    """``RATCHET_MCP_SERVERS_FILE``: ValueError with one line naming what is wrong."""
    text, _ = read_json(file)
    try:
        return parse_inline(text)
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}") from None


def _describe(exc: ValidationError) -> str:
    error = exc.errors()[0]
    if error["type"] == "string_pattern_mismatch" or (error["loc"] and error["loc"][-1] == "[key]"):
        name = error["loc"][0] if error["loc"] else "?"
        return f"server name {name!r} must match {NAME_PATTERN} (at most 64 characters)"
    return first_error(exc).replace("Value error, ", "")


def declared(inline: str, file: Path | None) -> dict[str, ServerConfig]:
    """The declared servers by name, from the setting and the file (the setting wins)."""
    return _declared(inline, None if file is None else str(file))


@lru_cache(maxsize=8)
def _declared(inline: str, file: str | None) -> dict[str, ServerConfig]:
    servers = parse_file(Path(file)) if file is not None else {}
    return servers | parse_inline(inline)


def current() -> dict[str, ServerConfig]:
    """The servers the current settings declare."""
    from shared.settings import get_settings

    settings = get_settings()
    return declared(settings.mcp_servers, settings.mcp_servers_file)
