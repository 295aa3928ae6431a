"""A benchmark that runs a worker refuses a database with unfinished tasks: its worker would
run them too, and its figures would measure them."""

from __future__ import annotations

import pytest
import typer
from fastapi.testclient import TestClient

from tests.conftest import TenantHandle


def test_a_worker_benchmark_stops_on_a_database_with_queued_tasks(
    client: TestClient, tenant: TenantHandle, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.harness.common import require_no_backlog

    submitted = client.post("/v1/tasks", json={"input": "left behind"}, headers=tenant.headers)
    assert submitted.status_code == 202

    with pytest.raises(typer.Exit) as stopped:
        require_no_backlog()

    assert stopped.value.exit_code == 2
    assert "queued or running tasks" in capsys.readouterr().err
