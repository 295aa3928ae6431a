"""The OpenAPI document is complete and true: schemathesis, with every check it has
(server errors, undocumented status codes and content types, response schemas and headers,
positive and negative data, ignored auth, …), over every operation of the app's own schema.

Reproducible: Hypothesis is derandomized and keeps no example database, so every run sends
the same requests. Bounded: ``MAX_EXAMPLES`` per operation and mode. Nothing can hang: every
``{task_id}`` is a task that has already succeeded, so ``?wait=`` answers at once and the
event stream ends after the replay.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.config import SchemathesisConfig

from tests.conftest import TenantHandle

MAX_EXAMPLES = 12
# A JSON schema cannot say these; the server checks them and answers a documented 422:
# cursors are opaque tokens only this API hands out; a submission names a registered agent,
# that agent's tools, a known model, a script valid for it and a webhook URL that resolves to
# a public address (as must an endpoint's); a key's expiry lies in the future; ``Last-Event-ID``
# is a number in range; a query string holds no NUL character; an edit fits its tool; a
# schedule's cron is one croniter accepts; a runtime limit fits its kind; a fork starts at
# one of its task's committed steps; a batch holds at most RATCHET_BATCH_MAX_TASKS items.
SEMANTIC_422 = (
    "POST /v1/tasks",
    "GET /v1/tasks",
    "GET /v1/tasks/{task_id}/steps",
    "GET /v1/tasks/{task_id}/children",
    "GET /v1/tasks/{task_id}/events",
    "GET /v1/tasks/{task_id}/webhook-deliveries",
    "GET /v1/agents",
    "GET /v1/agents/{name}/versions",
    "GET /v1/keys",
    "POST /v1/keys",
    "GET /v1/webhook-endpoints",
    "POST /v1/webhook-endpoints",
    "PATCH /v1/webhook-endpoints/{endpoint_id}",
    "GET /v1/admin/overview",
    "GET /v1/admin/tasks",
    "POST /v1/tasks/{task_id}/approvals/{call_id}",
    "POST /v1/schedules",  # a submission as above, and a cron expression croniter accepts
    "PUT /v1/admin/concurrency/{kind}/{name}",  # a limit valid for its kind
    "POST /v1/tasks/{task_id}/fork",  # a submission as above, from a committed step
    "POST /v1/threads",  # a registered agent
    "GET /v1/threads",
    "POST /v1/threads/{thread_id}/runs",  # a submission as above, of the thread's agent
    "POST /v1/threads/{thread_id}/fork",  # a turn the thread has
    "GET /v1/threads/{thread_id}/messages",
    "GET /v1/threads/{thread_id}/events",  # ``Last-Event-ID`` is ``<turn>:<seq>``
    "POST /v1/waits/{token}",  # a body that is JSON, within its size
    "PUT /v1/secrets/{name}",  # a value of at most 64 KiB as UTF-8 (the schema counts characters)
    "GET /v1/mcp-servers",
    "POST /v1/mcp-servers",  # a URL the egress policy allows, a name not the operator's
    "POST /v1/tasks/batch",  # at most RATCHET_BATCH_MAX_TASKS items
)
ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx"]  # schemathesis's default
# Invalid data must be refused: schemathesis's default statuses for that, and a body or header
# over the size limit refused as such (413 / 431, documented on every operation) — a
# generated body of megabytes of invalid data was refused by its size before its content.
REJECTED = [
    *("400", "401", "403", "404", "405", "406", "409", "415", "422", "428", "429", "5xx"),
    *("413", "431"),
]


def _succeeded_task(client: TestClient, tenant: TenantHandle, drive: Callable[..., str]) -> str:
    body = {"input": "hi", "model": "scripted", "model_options": {"script": [{"content": "ok"}]}}
    answer = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert answer.status_code == 202, answer.text
    assert drive(answer.json()["id"]) == "succeeded"
    return str(answer.json()["id"])


def _config(tenant: TenantHandle) -> Any:
    return SchemathesisConfig.from_dict(
        {
            "auth": {"openapi": {"apiKey": {"bearer": tenant.key}}},
            "checks": {"negative_data_rejection": {"expected-statuses": REJECTED}},
            "operations": [
                {
                    "include-name": name,
                    "checks": {
                        "positive_data_acceptance": {"expected-statuses": [*ACCEPTED, "422"]}
                    },
                }
                for name in SEMANTIC_422
            ],
        }
    )


def _run(
    operation: Any, mode: Any, path_parameters: dict[str, str], statuses: set[int]
) -> str | None:
    """Run one operation in one mode, adding the statuses it saw to ``statuses``; the
    failures schemathesis found, or None."""

    @given(case=operation.as_strategy(mode, path_parameters=path_parameters or None))
    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Any) -> None:
        statuses.add(case.call_and_validate().status_code)

    try:
        check()
    except Unsatisfiable:
        return None  # negative mode, and nothing in the operation can be made invalid
    except (AssertionError, BaseExceptionGroup) as exc:
        return f"{operation.label} ({mode.value}): {exc}"
    return None


# About 1,400 requests: under two minutes on a quiet machine, over five on a loaded one, where
# the suite's five-minute guard against a hang once cut it off in the middle of a case.
@pytest.mark.timeout(1200)
def test_every_operation_passes_every_check(
    service_env: dict[str, str],
    make_tenant: Callable[..., TenantHandle],
    drive: Callable[..., str],
) -> None:
    from api.main import create_app
    from shared.store.tenants import ADMIN, TENANT_SCOPES

    tenant = make_tenant((*TENANT_SCOPES, ADMIN))
    app = create_app()
    with TestClient(app) as client:
        task_id = _succeeded_task(client, tenant, drive)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=_config(tenant))
    failures: list[str] = []
    seen: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        fixed = {"task_id": task_id} if "{task_id}" in operation.path else {}
        for mode in schemathesis.GenerationMode:
            statuses = seen.setdefault(operation.label, set())
            failure = _run(operation, mode, fixed, statuses)
            if failure:
                failures.append(failure)
    assert not failures, "\n\n".join(failures)
    assert len(seen) == 60, sorted(seen)
    # The key was taken: every authenticated operation got past authentication at least once.
    assert [label for label, statuses in seen.items() if statuses <= {401}] == []
    assert {200, 422} <= seen["GET /v1/tasks/{task_id}/events"]
    assert 202 in seen["POST /v1/tasks"]


def test_root_redirects_to_the_dashboard(client: TestClient) -> None:
    answer = client.get("/", follow_redirects=False)
    assert answer.status_code == 307
    assert answer.headers["location"] == "/dashboard"
    assert 'type="password"' in client.get("/").text  # its login page
    assert client.get("/docs").status_code == 200


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_pages_need_no_cdn(client: TestClient, page: str) -> None:
    html = client.get(page).text
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert assets, html
    for asset in assets:
        assert asset.startswith("/"), f"{page} loads {asset} from elsewhere"
        assert client.get(asset).status_code == 200, asset


def _operations(document: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{method.upper()} {path}", operation)
        for path, methods in document["paths"].items()
        for method, operation in methods.items()
    ]


def test_every_authenticated_operation_names_the_bearer_scheme(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    scheme = document["components"]["securitySchemes"]["apiKey"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    for name, operation in _operations(document):
        is_open = name in ("GET /healthz", "GET /readyz")
        assert ("security" not in operation) is is_open, name
        if not is_open:
            assert operation["security"] == [{"apiKey": []}], name
            for status in ("400", "401", "403", "413", "422", "431", "503"):
                assert status in operation["responses"], (name, status)
        assert operation.get("summary"), name
        assert operation.get("description"), name


def test_every_error_is_a_documented_problem(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    problem = document["components"]["schemas"]["Problem"]
    assert set(problem["required"]) == {"type", "title", "status", "detail"}
    assert "errors" in problem["properties"]
    assert "HTTPValidationError" not in document["components"]["schemas"]
    for name, operation in _operations(document):
        for status, answer in operation["responses"].items():
            if int(status) >= 400:
                content = answer["content"]
                assert list(content) == ["application/problem+json"], (name, status)
                assert content["application/problem+json"]["schema"] == {
                    "$ref": "#/components/schemas/Problem"
                }


def test_the_document_describes_the_stream_and_the_submission(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    stream = document["paths"]["/v1/tasks/{task_id}/events"]["get"]["responses"]["200"]
    assert list(stream["content"]) == ["text/event-stream"]
    schemas = document["components"]["schemas"]
    body = schemas["TaskCreate"]["properties"]
    assert body["model_options"]["properties"]["script"]["items"] == {
        "$ref": "#/components/schemas/ScriptTurn"
    }
    assert {"content", "tool_calls", "delay_ms", "error", "times", "usage"} <= set(
        schemas["ScriptTurn"]["properties"]
    )
    assert {"max_tokens", "max_cost_usd"} <= set(schemas["Budget"]["properties"])
    assert body["instructions"]["description"]
    kinds = body["input"]["anyOf"]
    assert kinds[0]["type"] == "string"
    assert kinds[1]["items"] == {"$ref": "#/components/schemas/InputMessage"}
    for name in ("agent", "input", "model", "model_options", "tools", "max_steps", "metadata"):
        assert body[name].get("description"), name


def test_no_request_body_admits_what_every_route_refuses(client: TestClient) -> None:
    """Every body is refused a NUL in any string or key (api/body_text.py): the document says
    so, or a fuzzer's schema-valid body is refused (schemathesis's ST202)."""
    document = client.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    assert schemas["EndpointCreate"]["properties"]["url"]["pattern"] == "^[^\\x00]*$"
    spec = document["paths"]["/v1/admin/concurrency/{kind}/{name}"]["put"]["requestBody"]
    body = spec["content"]["application/json"]["schema"]
    assert body["additionalProperties"] == {"$ref": "#/components/schemas/JsonValue"}
    assert body["propertyNames"] == {"pattern": "^[^\\x00]*$"}
    assert schemas["TaskCreate"]["not"] == {"required": ["run_at", "delay_seconds"]}


def test_the_browser_gets_a_favicon_from_the_api(client: TestClient) -> None:
    icon = client.get("/favicon.ico")

    assert icon.status_code == 200
    assert icon.headers["content-type"] == "image/x-icon"
    assert icon.content[:4] == b"\x00\x00\x01\x00"  # an ICO file's header: one or more icons
    for page in ("/docs", "/redoc"):
        assert 'href="/favicon.ico"' in client.get(page).text, page


def test_swagger_ui_asks_no_outside_validator(client: TestClient) -> None:
    """Swagger UI's default would load a badge from validator.swagger.io on every visit."""
    assert '"validatorUrl": null' in client.get("/docs").text


def test_each_error_status_has_an_example_of_its_own(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    assert "examples" not in document["components"]["schemas"]["Problem"]
    for name, operation in _operations(document):
        for status, answer in operation["responses"].items():
            if int(status) >= 400:
                example = answer["content"]["application/problem+json"]["example"]
                assert example["status"] == int(status), (name, status)
                assert example["title"] in answer["description"], (name, status)
                assert example["detail"], (name, status)
                assert ("errors" in example) is (int(status) == 422), (name, status)


def test_the_schedules_have_a_tag_of_their_own(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    tagged = {
        name: operation["tags"]
        for name, operation in _operations(document)
        if "/v1/schedules" in name
    }

    assert len(tagged) == 6, tagged
    assert all(tags == ["schedules"] for tags in tagged.values()), tagged
    assert "schedules" in {tag["name"] for tag in document["tags"]}
