"""The tenant secrets a tool call is handed, and its outcome with their values redacted.

A tool gets the secrets it declares (``@tool(secrets=…)``) that its task's tenant has set,
read and decrypted just before the call (so a secret set or deleted a moment ago counts), and
no others; a tool that declares none costs no query. Whatever the call returns or raises has
those values replaced by ``[secret:NAME]`` before the ledger, the events or the model see it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from shared.agents.registry import Tool
from shared.observability.redaction import redact, redact_text
from shared.store import tenant_secrets as secret_store
from shared.store.db import transaction
from shared.vault import get_vault
from workers.tool_runner import Outcome


def for_call(tenant_id: str, tool: Tool) -> dict[str, str]:
    """The declared secrets the tenant has set, by name. SecretsNotConfigured without a key,
    SecretUnreadable for a value no configured key opens."""
    if not tool.secrets:
        return {}
    vault = get_vault()
    with transaction() as session:
        return secret_store.values_for(session, tenant_id, tool.secrets, vault=vault)


def redacted(outcome: Outcome, secrets: Mapping[str, str]) -> Outcome:
    """``outcome`` with the secrets' values replaced in its result and its error."""
    if not secrets:
        return outcome
    error = None if outcome.error is None else redact_text(outcome.error, secrets)
    return replace(outcome, result=redact(outcome.result, secrets), error=error)
