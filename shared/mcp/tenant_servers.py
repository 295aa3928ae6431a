"""The MCP servers a tenant registered (``/v1/mcp-servers``), as configurations a process
can connect with: Streamable HTTP only (a tenant never starts a process on a worker), their
headers decrypted and each ``${secret:NAME}`` in them replaced by the tenant's secret when a
task's tools are resolved, in memory only: the resolved value is never stored or shown.

Their names never shadow the operator's: registering a name the operator declares is refused,
and were the operator to declare one later, the operator's server is the one its tasks see.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping

from sqlalchemy.orm import Session

from shared.errors import Conflict
from shared.mcp.config import ServerConfig
from shared.store import mcp_servers as server_store
from shared.store import tenant_secrets
from shared.store.db import transaction
from shared.vault import get_vault

SECRET_REFERENCE = re.compile(r"\$\{secret:([A-Z][A-Z0-9_]{0,63})\}")


def referenced(headers: Mapping[str, str]) -> tuple[str, ...]:
    """The secrets ``headers`` name, each once, in order."""
    found = [m.group(1) for value in headers.values() for m in SECRET_REFERENCE.finditer(value)]
    return tuple(dict.fromkeys(found))


def configs(
    tenant_id: str, names: Iterable[str]
) -> dict[str, tuple[ServerConfig | str, tuple[str, ...]]]:
    """Those of ``names`` the tenant registered: each its configuration with its headers
    resolved (or why it cannot be used now: no key, or a secret it names that the tenant has
    not set), and the secrets its headers name."""
    wanted = list(names)
    with transaction() as session:
        rows = server_store.named(session, tenant_id, wanted)
        found: dict[str, tuple[ServerConfig | str, tuple[str, ...]]] = {}
        for row in rows:
            try:
                headers = _headers(row.headers_ciphertext, name=row.name)
                secrets = referenced(headers)
                values = _secret_values(session, tenant_id, secrets)
            except Conflict as exc:  # no key, or one that no longer opens the headers
                found[row.name] = (f"MCP server {row.name!r}: {exc}", ())
                continue
            missing = [name for name in secrets if name not in values]
            if missing:
                why = f"its headers name secret(s) the tenant has not set: {', '.join(missing)}"
                found[row.name] = (f"MCP server {row.name!r}: {why}", secrets)
                continue
            resolved = {k: _resolve(v, values) for k, v in headers.items()}
            config = ServerConfig(
                url=row.url, headers=resolved, timeout_seconds=row.timeout_seconds
            )
            found[row.name] = (config, secrets)
    return found


def _headers(ciphertext: str | None, *, name: str) -> dict[str, str]:
    if ciphertext is None:
        return {}
    headers: dict[str, str] = json.loads(get_vault().decrypt(ciphertext, name=f"{name} headers"))
    return headers


def _secret_values(session: Session, tenant_id: str, names: tuple[str, ...]) -> dict[str, str]:
    if not names:
        return {}
    return tenant_secrets.values_for(session, tenant_id, names, vault=get_vault())


def _resolve(value: str, secrets: Mapping[str, str]) -> str:
    return SECRET_REFERENCE.sub(lambda m: secrets[m.group(1)], value)
