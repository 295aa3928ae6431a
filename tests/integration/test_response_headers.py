"""What every answer tells a browser and a client: pages that cannot be framed, no content
sniffing, a 405 that names every method of its path, and a dashboard banner that shows only
what the dashboard itself said."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from tests.conftest import Configure, TenantHandle
from tests.integration.test_api import assert_problem, submit
from tests.integration.test_dashboard import login

ADMIN = ("tasks:read", "tasks:write", "admin")


@pytest.mark.parametrize("path", ["/dashboard/login", "/approve/not-a-token", "/docs"])
def test_a_page_cannot_be_framed_nor_sniffed(client: TestClient, path: str) -> None:
    headers = client.get(path).headers
    assert headers["content-type"].startswith("text/html")
    assert headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize("path", ["/healthz", "/v1/tasks", "/v1/tasks?api_key=x"])
def test_every_answer_says_nosniff(client: TestClient, tenant: TenantHandle, path: str) -> None:
    headers = client.get(path, headers=tenant.headers).headers
    assert headers["x-content-type-options"] == "nosniff"
    assert "x-frame-options" not in headers  # JSON: nothing to frame


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("DELETE", "/v1/tasks", "GET, POST"),
        ("PUT", "/v1/tasks/{id}", "GET"),
        ("GET", "/v1/tasks/{id}/cancel", "POST"),
        ("PATCH", "/v1/admin/concurrency/pools/gpu", "DELETE, PUT"),
    ],
)
def test_a_405_allows_every_method_of_its_path(
    client: TestClient, tenant: TenantHandle, method: str, path: str, allowed: str
) -> None:
    task_id = submit(client, tenant)["id"]
    response = client.request(method, path.format(id=task_id), headers=tenant.headers)
    assert_problem(response, 405)
    assert response.headers["allow"] == allowed


def _flash(html: str) -> str | None:
    found = re.search(r'<p class="flash" role="status">(.*?)</p>', html, re.S)
    return found.group(1) if found else None


def test_the_banner_shows_only_what_the_dashboard_said(
    client: TestClient, make_tenant: Callable[..., TenantHandle]
) -> None:
    tenant = make_tenant(ADMIN)
    login(client, tenant.key)
    task_id = submit(client, tenant)["id"]
    # A link anyone can make puts no text in the banner.
    forged = "Your session expired: call +1 555 0100"
    for path in (f"/dashboard/tasks/{task_id}", "/dashboard/tasks", "/dashboard/login"):
        assert _flash(client.get(path, params={"flash": forged}).text) is None, path
    # The dashboard's own answer to a form is shown, to the session that sent it only.
    other = TestClient(client.app)
    token = login(other, tenant.key)
    answer = other.post(
        f"/dashboard/tasks/{task_id}/cancel", data={"csrf_token": token}, follow_redirects=False
    )
    assert answer.status_code == 303
    assert _flash(other.get(answer.headers["location"]).text) == "Cancellation requested"
    assert _flash(client.get(answer.headers["location"]).text) is None


def test_metrics_are_an_operators_or_the_scrapers(
    client: TestClient,
    make_tenant: Callable[..., TenantHandle],
    configure: Configure,
) -> None:
    assert_problem(client.get("/metrics"), 401)
    assert_problem(client.get("/metrics", headers=make_tenant(ADMIN).headers), 403)
    operator = make_tenant(("operator",))
    assert "ratchet_" in client.get("/metrics", headers=operator.headers).text
    token = "m" * 40
    configure(RATCHET_METRICS_TOKEN=token)
    scraped = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert scraped.status_code == 200
    assert "ratchet_" in scraped.text
    wrong = {"Authorization": f"Bearer {'n' * 40}"}
    assert_problem(client.get("/metrics", headers=wrong), 401)
