"""What a tenant admin can do to its tenant's own MCP servers: register, list and remove
them, each one transaction recorded in the audit log (``shared.store.audit``).

A server is a Streamable HTTP URL (never a command: a tenant never starts a process on a
worker), checked against the egress policy here and again by each process that connects. Its
headers may name the tenant's secrets (``"Bearer ${secret:TOKEN}"``), resolved when a process
connects (``shared.mcp.tenant_servers``); they are stored encrypted and never shown, only
their names. A name the operator declares is refused: a tenant's server never shadows one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from sqlalchemy.orm import Session

from shared.errors import Conflict, EgressDenied, InvalidRequest
from shared.mcp.config import current
from shared.mcp.names import NAME_PATTERN
from shared.settings import get_settings
from shared.store import audit
from shared.store import mcp_servers as server_store
from shared.store.tables import TenantMcpServer
from shared.vault import get_vault
from shared.webhooks.egress import check_url

MAX_SERVERS_PER_TENANT = 50
MAX_HEADERS = 20
MAX_HEADER_VALUE_CHARS = 8192
_NAME = re.compile(rf"^{NAME_PATTERN}$")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}$")  # an HTTP token
_REFERENCE = re.compile(r"\$\{secret:([^}]*)\}")
_SECRET_NAME = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")


def check_name(name: str) -> None:
    if len(name) > 64 or not _NAME.fullmatch(name):
        raise InvalidRequest("name", f"1 to 64 characters of {NAME_PATTERN}")
    if name in current():
        raise InvalidRequest(
            "name", f"the operator declares an MCP server named {name!r}: choose another"
        )


def check_destination(url: str) -> None:
    """The egress policy's word on ``url`` (loopback, private and metadata addresses only if
    the operator allow-lists them), as a 422 naming ``url``."""
    try:
        check_url(url, allowed_hosts=get_settings().http_allowed_hosts)
    except EgressDenied as exc:
        raise InvalidRequest("url", str(exc)) from None


def check_headers(headers: Mapping[str, str]) -> None:
    if len(headers) > MAX_HEADERS:
        raise InvalidRequest("headers", f"at most {MAX_HEADERS} headers")
    for name, value in headers.items():
        if not _HEADER_NAME.fullmatch(name):
            raise InvalidRequest(f"headers.{name}", "not an HTTP header name")
        if len(value) > MAX_HEADER_VALUE_CHARS or "\r" in value or "\n" in value:
            raise InvalidRequest(
                f"headers.{name}", f"one line of at most {MAX_HEADER_VALUE_CHARS} characters"
            )
        for reference in _REFERENCE.finditer(value):
            if not _SECRET_NAME.fullmatch(reference.group(1)):
                raise InvalidRequest(
                    f"headers.{name}", f"${{secret:{reference.group(1)}}} names no valid secret"
                )


def add_server(
    session: Session,
    tenant_id: str,
    *,
    name: str,
    url: str,
    headers: Mapping[str, str],
    timeout_seconds: float,
    actor: str,
) -> TenantMcpServer:
    """Register the tenant's server. InvalidRequest for a bad or taken-by-the-operator name,
    a URL the egress policy refuses or bad headers; SecretsNotConfigured for headers without
    a key to encrypt them; Conflict for a name the tenant already uses, or past
    ``MAX_SERVERS_PER_TENANT``."""
    check_name(name)
    check_headers(headers)
    check_destination(url)
    ciphertext = get_vault().encrypt(json.dumps(dict(headers))) if headers else None
    with session.begin():
        if server_store.count(session, tenant_id) >= MAX_SERVERS_PER_TENANT:
            raise Conflict(f"a tenant has at most {MAX_SERVERS_PER_TENANT} MCP servers")
        row = server_store.add(
            session,
            tenant_id,
            name=name,
            url=url,
            headers_ciphertext=ciphertext,
            header_names=sorted(headers),
            timeout_seconds=timeout_seconds,
        )
        audit.record(session, tenant_id, actor=actor, action="mcp_server.add", target=name)
        session.expunge(row)
    return row


def remove_server(session: Session, tenant_id: str, server_id: str, *, actor: str) -> None:
    """Remove the tenant's server (NotFound if it has none of that id, another tenant's
    included). Tasks that name it find no such server from their next step on."""
    with session.begin():
        row = server_store.remove(session, tenant_id, server_id)
        audit.record(session, tenant_id, actor=actor, action="mcp_server.remove", target=row.name)


def list_servers(
    session: Session, tenant_id: str, *, after: str | None, limit: int
) -> Sequence[TenantMcpServer]:
    with session.begin():
        rows = server_store.list_for(session, tenant_id, after=after, limit=limit)
        session.expunge_all()
    return rows
