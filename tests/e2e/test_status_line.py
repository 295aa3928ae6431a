"""A problem's ``title`` is the reason phrase on the status line a real ``ratchet api`` sends,
whichever layer answers: a route, FastAPI's validation, the body limit, the URL-credential
guard, or the server's own header limit."""

from __future__ import annotations

from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory


def test_problem_titles_match_the_status_line(stack: StackFactory, tenant: TenantHandle) -> None:
    fleet = stack(workers=0, env={"RATCHET_MAX_REQUEST_BYTES": "2048"})
    with fleet.client() as http:
        answers = {
            400: http.get("/v1/tasks", params={"api_key": "x"}),
            401: http.get("/v1/tasks"),
            404: http.get("/v1/tasks/nope", headers=tenant.headers),
            413: http.post("/v1/tasks", headers=tenant.headers, content=b"x" * 4096),
            422: http.get("/v1/tasks", params={"limit": "0"}, headers=tenant.headers),
            431: http.get("/healthz", headers={"x-big": "a" * 200_000}),
        }
    for status, answer in answers.items():
        assert answer.status_code == status, (status, answer.text)
        assert answer.headers["content-type"] == "application/problem+json", status
        assert answer.json()["title"] == answer.reason_phrase, status
