"""``ratchet webhooks``, run as a process: a tenant's default endpoints added, listed, changed,
disabled, re-enabled and removed; the result alone on stdout, every failure one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TenantHandle
from tests.e2e.conftest import Run, run_ratchet
from tests.e2e.test_cli import assert_one_line_error

URL = "https://localhost/hooks/ratchet"  # allow-listed in the tests' environment


@pytest.fixture
def webhooks(service_env: dict[str, str], tmp_path: Path) -> Run:
    """Run ``python -m ratchet webhooks ARGS`` with this run's services, away from any .env."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return run_ratchet("webhooks", *args, env=service_env, cwd=tmp_path)

    return run


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def document(result: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(ok(result))


def test_an_endpoint_is_added_listed_changed_disabled_enabled_and_deleted(
    webhooks: Run, tenant: TenantHandle
) -> None:
    tenant_args = ("--tenant", tenant.name)
    endpoint_id = ok(webhooks("add", *tenant_args, "--url", URL)).strip()

    [listed] = document(webhooks("list", *tenant_args))
    assert listed["id"] == endpoint_id
    assert (listed["url"], listed["enabled"], listed["tenant_id"]) == (URL, True, tenant.id)
    assert listed["events"] == ["task.cancelled", "task.failed", "task.succeeded"]
    assert listed["deliveries"] == {"succeeded": 0, "failed": 0, "pending": 0}
    assert endpoint_id in {e["id"] for e in document(webhooks("list"))}  # every tenant's

    changed = document(
        webhooks(
            "update", endpoint_id, *tenant_args, "--event", "task.queued", "--event", "task.failed"
        )
    )
    assert (changed["url"], changed["events"]) == (URL, ["task.failed", "task.queued"])
    disabled = document(webhooks("disable", endpoint_id, *tenant_args, "--reason", "maintenance"))
    assert (disabled["enabled"], disabled["disabled_reason"]) == (False, "maintenance")
    enabled = document(webhooks("enable", endpoint_id, *tenant_args))
    assert (enabled["enabled"], enabled["disabled_reason"]) == (True, None)

    deleted = webhooks("delete", endpoint_id, *tenant_args)
    assert (ok(deleted), deleted.stderr.strip()) == ("", f"deleted webhook endpoint {endpoint_id}")
    assert document(webhooks("list", *tenant_args)) == []
    assert_one_line_error(webhooks("delete", endpoint_id, *tenant_args), "no webhook endpoint")


def test_add_endpoint_still_adds_one(webhooks: Run, tenant: TenantHandle) -> None:
    added = ok(
        webhooks("add-endpoint", "--tenant", tenant.name, "--url", URL, "--event", "task.failed")
    )

    [listed] = document(webhooks("list", "--tenant", tenant.name))
    assert (listed["id"], listed["events"]) == (added.strip(), ["task.failed"])
    assert "add-endpoint" not in ok(webhooks("--help"))


def test_refusals_are_one_line_and_change_nothing(webhooks: Run, tenant: TenantHandle) -> None:
    tenant_args = ("--tenant", tenant.name)

    assert_one_line_error(
        webhooks("add", *tenant_args, "--url", URL, "--event", "task.nope"), "task.nope"
    )
    assert_one_line_error(
        webhooks("add", *tenant_args, "--url", "https://10.1.2.3/hook"),
        "RATCHET_WEBHOOK_ALLOWED_HOSTS",
    )
    endpoint_id = ok(webhooks("add", *tenant_args, "--url", URL)).strip()
    assert_one_line_error(webhooks("update", endpoint_id, *tenant_args), "--url or --event")
    assert_one_line_error(
        webhooks("update", endpoint_id, *tenant_args, "--url", "http://example.com/"), "https"
    )
    assert_one_line_error(webhooks("enable", endpoint_id, "--tenant", "nobody"), "nobody")
    [unchanged] = document(webhooks("list", *tenant_args))
    assert (unchanged["id"], unchanged["url"]) == (endpoint_id, URL)
