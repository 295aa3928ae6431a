"""Fork and replay (``POST /v1/tasks/{id}/fork``): a fork reuses its origin's committed model
responses and tool results, never asking or running them again, then goes on with its own
settings; the origin is untouched. On the real store, PostgreSQL and SQLite."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from shared.store.db import transaction
from shared.store.tables import Step, Task, TaskEvent, ToolCall
from tests.conftest import TenantHandle
from tests.fakes.openai_server import OpenAIServer, answer, tool_call
from tests.fakes.reader import Reader
from tests.helpers import scripted_task
from tests.integration import test_admission_messages, test_context_window

pytestmark = pytest.mark.backends("postgresql", "sqlite")
reader_server = test_context_window.reader_server  # a fixture: the book-reading test model
queue = test_admission_messages.queue  # a fixture: a broker queue of the test's own

MODEL = "openai:gpt-4o-mini"
FORK_MODEL = "openai:gpt-fork"


def _submit(client: TestClient, tenant: TenantHandle, body: dict[str, Any]) -> str:
    response = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _fork(client: TestClient, tenant: TenantHandle, task_id: str, **body: Any) -> dict[str, Any]:
    response = client.post(f"/v1/tasks/{task_id}/fork", json=body, headers=tenant.headers)
    assert response.status_code == 202, response.text
    assert response.headers["Location"] == f"/v1/tasks/{response.json()['id']}"
    return dict(response.json())


def _get(client: TestClient, tenant: TenantHandle, path: str) -> Any:
    response = client.get(path, headers=tenant.headers)
    assert response.status_code == 200, response.text
    return response.json()


def _effects(journal: Path) -> list[str]:
    """The side effects the sample tools performed: ``<kind> <idempotency key>``, in order."""
    return journal.read_text().splitlines()


def _email(n: int) -> dict[str, Any]:
    return {"to": "ops@example.com", "subject": f"report {n}"}


def _four_steps(
    client: TestClient,
    tenant: TenantHandle,
    server: OpenAIServer,
    drive: Callable[..., str],
) -> str:
    """A finished 4-step task: three steps that each send an email, then the answer."""
    server.reply(
        tool_call("send_email", _email(1), call_id="call_a"),
        tool_call("send_email", _email(2), call_id="call_b"),
        tool_call("send_email", _email(3), call_id="call_c"),
        answer("three reports sent"),
    )
    task_id = _submit(
        client,
        tenant,
        {"agent": "ops", "input": "send the reports", "model": MODEL, "tools": ["send_email"]},
    )
    assert drive(task_id) == "succeeded"
    assert len(server.requests) == 4
    return task_id


def test_a_fork_from_step_2_reuses_steps_1_and_2_and_runs_on_with_the_new_model(
    client: TestClient,
    tenant: TenantHandle,
    openai_provider: OpenAIServer,
    drive: Callable[..., str],
    journal: Path,
) -> None:
    server = openai_provider
    origin = _four_steps(client, tenant, server, drive)
    origin_task = _get(client, tenant, f"/v1/tasks/{origin}")
    origin_steps = _get(client, tenant, f"/v1/tasks/{origin}/steps")
    origin_effects = _effects(journal)
    assert origin_effects == [f"email {origin}:{n}-0" for n in (1, 2, 3)]
    step_3_prompt = server.requests[2].messages  # steps 1-2's messages, as the origin sent

    server.reply(
        tool_call("send_email", _email(30), call_id="call_fork"), answer("forked and done")
    )
    fork = _fork(client, tenant, origin, from_step=2, model=FORK_MODEL)
    assert fork["status"] == "queued"
    assert fork["steps"] == 2
    assert fork["forked_from"] == {
        "task_id": origin,
        "step": 2,
        "replaced_input": False,
        "replaced_tool_results": [],
    }
    assert drive(fork["id"]) == "succeeded"

    # No model call for steps 1-2: the fork asked twice (its steps 3 and 4), the new model,
    # and its first prompt holds steps 1-2's messages exactly as the origin sent them.
    fork_requests = server.requests[4:]
    assert len(fork_requests) == 2
    assert [r.body["model"] for r in fork_requests] == ["gpt-fork", "gpt-fork"]
    assert fork_requests[0].messages == step_3_prompt
    assert [m["role"] for m in step_3_prompt[-4:]] == ["assistant", "tool", "assistant", "tool"]
    # No tool call for steps 1-2: the only new side effect is the fork's own step 3, with
    # the fork's own key.
    assert _effects(journal) == [*origin_effects, f"email {fork['id']}:3-0"]

    done = _get(client, tenant, f"/v1/tasks/{fork['id']}")
    assert (done["steps"], done["result"]) == (4, {"output": "forked and done"})
    assert done["usage"]["input_tokens"] == 2 * 20  # only its own calls: the fork's usage
    steps = _get(client, tenant, f"/v1/tasks/{fork['id']}/steps")["items"]
    assert [(s["number"], s["forked"]) for s in steps] == [
        (1, True),
        (2, True),
        (3, False),
        (4, False),
    ]
    keys = [c["idempotency_key"] for s in steps for c in s["tool_calls"]]
    assert keys == [f"{origin}:1-0", f"{origin}:2-0", f"{fork['id']}:3-0"]
    for inherited, kept in zip(steps[:2], origin_steps["items"][:2], strict=True):
        assert inherited["model"] == kept["model"]
        assert inherited["tool_calls"] == kept["tool_calls"]

    with transaction() as session:
        first = session.scalars(
            select(TaskEvent).where(TaskEvent.task_id == fork["id"]).order_by(TaskEvent.seq)
        ).first()
        assert first is not None
        assert (first.seq, first.type) == (1, "task.queued")
        assert first.data["forked_from"]["task_id"] == origin

    # The origin is untouched.
    assert _get(client, tenant, f"/v1/tasks/{origin}") == origin_task
    assert _get(client, tenant, f"/v1/tasks/{origin}/steps") == origin_steps


def test_from_step_0_is_a_fresh_run_of_the_same_input(
    client: TestClient,
    tenant: TenantHandle,
    openai_provider: OpenAIServer,
    drive: Callable[..., str],
    journal: Path,
) -> None:
    server = openai_provider
    origin = _four_steps(client, tenant, server, drive)
    first_prompt = server.requests[0].messages
    server.reply(answer("nothing to send"))

    fork = _fork(client, tenant, origin, from_step=0)
    assert fork["steps"] == 0
    assert drive(fork["id"]) == "succeeded"

    assert len(server.requests) == 5
    assert server.requests[4].messages == first_prompt
    assert server.requests[4].body["model"] == "gpt-4o-mini"  # the origin's, inherited
    steps = _get(client, tenant, f"/v1/tasks/{fork['id']}/steps")["items"]
    assert [(s["number"], s["forked"]) for s in steps] == [(1, False)]
    assert len(_effects(journal)) == 3  # the origin's only


def test_a_replaced_tool_result_reaches_the_model(
    client: TestClient,
    tenant: TenantHandle,
    openai_provider: OpenAIServer,
    drive: Callable[..., str],
) -> None:
    server = openai_provider
    origin = _four_steps(client, tenant, server, drive)
    server.reply(answer("bounced, noted"))

    fork = _fork(
        client,
        tenant,
        origin,
        from_step=2,
        tool_results={"call_b": {"bounced": True}},
        instructions="Say when an email bounced.",
    )
    assert fork["forked_from"]["replaced_tool_results"] == ["call_b"]
    assert drive(fork["id"]) == "succeeded"

    prompt = server.requests[4].messages
    assert prompt[0]["content"].endswith("Say when an email bounced.")
    results = {m["tool_call_id"]: m["content"] for m in prompt if m["role"] == "tool"}
    assert "bounced" in results["call_b"]
    assert "bounced" not in results["call_a"]
    steps = _get(client, tenant, f"/v1/tasks/{fork['id']}/steps")["items"]
    assert steps[1]["tool_calls"][0]["result"] == {"bounced": True}
    kept = _get(client, tenant, f"/v1/tasks/{origin}/steps")["items"]
    assert kept[1]["tool_calls"][0]["result"] == "sent 'report 2' to ops@example.com"


def _waits_at_step_3(client: TestClient, tenant: TenantHandle, drive: Callable[..., str]) -> str:
    """A scripted task whose steps 1-2 are committed and whose step 3 waits for a person."""
    script = [
        {"tool_calls": [{"name": "calculator", "arguments": {"expression": "1+1"}}]},
        {"tool_calls": [{"name": "upsert_record", "arguments": {"key": "k"}}]},
        {"tool_calls": [{"name": "wire_money", "arguments": {"to": "bob", "amount": 5}}]},
        {"content": "wired"},
    ]
    task_id = _submit(client, tenant, scripted_task(script, agent="ops"))
    assert drive(task_id) == "awaiting_approval"
    return task_id


def test_a_waiting_task_forks_from_its_committed_steps_only(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str], journal: Path
) -> None:
    origin = _waits_at_step_3(client, tenant, drive)
    waiting = _get(client, tenant, f"/v1/tasks/{origin}")

    refused = client.post(f"/v1/tasks/{origin}/fork", json={"from_step": 3}, headers=tenant.headers)
    assert refused.status_code == 422, refused.text
    assert refused.json()["errors"][0]["field"] == "from_step"

    # The scripted model's turn n answers step n: turns 1-2 are never asked again.
    unused = {"content": "never asked"}
    again = {"tool_calls": [{"name": "upsert_record", "arguments": {"key": "f"}}]}
    script = [unused, unused, again, {"content": "stored"}]
    fork = _fork(client, tenant, origin, from_step=2, model_options={"script": script})
    assert drive(fork["id"]) == "succeeded"
    grandchild = _fork(client, tenant, fork["id"], from_step=3)  # a fork of a fork
    assert drive(grandchild["id"]) == "succeeded"
    assert _get(client, tenant, f"/v1/tasks/{grandchild['id']}")["result"] == {"output": "stored"}

    keys = [
        c["idempotency_key"]
        for s in _get(client, tenant, f"/v1/tasks/{grandchild['id']}/steps")["items"]
        for c in s["tool_calls"]
    ]
    assert keys[:3] == [f"{origin}:1-0", f"{origin}:2-0", f"{fork['id']}:3-0"]
    effects = _effects(journal)
    assert effects == [f"upsert {origin}:2-0", f"upsert {fork['id']}:3-0"]
    assert _get(client, tenant, f"/v1/tasks/{origin}") == waiting


def _task_count() -> int:
    with transaction() as session:
        return int(session.scalar(select(func.count()).select_from(Task)) or 0)


def _row_counts() -> tuple[int, int, int]:
    with transaction() as session:
        return tuple(  # type: ignore[return-value]
            int(session.scalar(select(func.count()).select_from(table)) or 0)
            for table in (Task, Step, ToolCall)
        )


def test_another_tenants_task_is_not_found(
    client: TestClient,
    make_tenant: Callable[..., TenantHandle],
    drive: Callable[..., str],
) -> None:
    owner, other = make_tenant(), make_tenant()
    origin = _waits_at_step_3(client, owner, drive)
    before = _row_counts()
    for task_id in (origin, "00000000-0000-0000-0000-000000000000"):
        response = client.post(
            f"/v1/tasks/{task_id}/fork", json={"from_step": 1}, headers=other.headers
        )
        assert response.status_code == 404, response.text
        assert response.headers["content-type"] == "application/problem+json"
    assert _row_counts() == before


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"from_step": 5}, "from_step"),
        ({"from_step": -1}, "from_step"),
        ({"from_step": "two"}, "from_step"),
        ({}, "from_step"),
        ({"from_step": 2, "tool_results": {"call_nope": 1}}, "tool_results.call_nope"),
        ({"from_step": 0, "tool_results": {"call_1_0": 1}}, "tool_results"),
        ({"from_step": 2, "max_steps": 2}, "max_steps"),
        ({"from_step": 2, "model": "nope:model"}, "model"),
        ({"from_step": 2, "tools": ["no_such_tool"]}, "tools[0]"),
        ({"from_step": 2, "agent": "other"}, "agent"),
    ],
)
def test_bad_input_is_a_problem_and_changes_nothing(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    body: dict[str, Any],
    field: str,
) -> None:
    origin = _waits_at_step_3(client, tenant, drive)
    before = _row_counts()
    response = client.post(f"/v1/tasks/{origin}/fork", json=body, headers=tenant.headers)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert [e["field"] for e in response.json()["errors"]] == [field]
    assert _row_counts() == before


def test_an_idempotency_key_returns_the_fork_it_made(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    origin = _waits_at_step_3(client, tenant, drive)
    headers = tenant.headers | {"Idempotency-Key": "fork-once"}
    first = client.post(f"/v1/tasks/{origin}/fork", json={"from_step": 2}, headers=headers)
    again = client.post(f"/v1/tasks/{origin}/fork", json={"from_step": 2}, headers=headers)
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    before = _task_count()
    other = client.post(f"/v1/tasks/{origin}/fork", json={"from_step": 1}, headers=headers)
    assert other.status_code == 422, other.text
    assert _task_count() == before


def test_the_dashboard_task_page_links_a_fork_to_its_origin(
    client: TestClient, make_tenant: Callable[..., TenantHandle], drive: Callable[..., str]
) -> None:
    from shared.store.tenants import DEFAULT_SCOPES
    from tests.integration.test_dashboard import login

    admin = make_tenant((*DEFAULT_SCOPES, "admin"))
    origin = _waits_at_step_3(client, admin, drive)
    fork = _fork(client, admin, origin, from_step=2)
    login(client, admin.key)
    page = client.get(f"/dashboard/tasks/{fork['id']}").text
    assert f'<a href="/dashboard/tasks/{origin}"><code>{origin}</code></a> at step 2' in page
    assert page.count(">inherited</span>") == 2
    assert f"<code>{origin}:2-0</code>" in page  # the key the inherited call ran with


def test_a_fork_that_drops_a_tool_drops_its_approvals(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    script = [{"tool_calls": [{"name": "calculator", "arguments": {"expression": "2*3"}}]}]
    body = scripted_task(
        [*script, {"content": "6"}],
        agent="ops",
        tools=["calculator", "upsert_record"],
        approval={"tools": ["upsert_record"]},
    )
    origin = _submit(client, tenant, body)
    assert drive(origin) == "succeeded"

    fork = _fork(client, tenant, origin, from_step=1, tools=["calculator"])
    assert drive(fork["id"]) == "succeeded"
    with transaction() as session:
        row = session.get(Task, fork["id"])
        assert row is not None
        assert (row.tools, row.approval) == (["calculator"], {"tools": []})


def test_the_python_client_forks(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    from ratchet.client import Client, RatchetAPIError

    origin = _waits_at_step_3(client, tenant, drive)
    through = Client("http://testserver", tenant.key)
    through._http = TestClient(client.app, headers=tenant.headers)
    fork = through.fork(origin, 2, instructions="Be brief.", idempotency_key="k1")
    assert (fork["forked_from"]["task_id"], fork["steps"]) == (origin, 2)
    assert through.fork(origin, 2, instructions="Be brief.", idempotency_key="k1") == fork
    with pytest.raises(RatchetAPIError) as refused:
        through.fork(origin, 3)
    assert refused.value.status == 422


def test_a_fork_keeps_the_summaries_of_its_steps_and_sends_the_prompt_its_origin_sent(
    reader_server: Callable[[int], tuple[OpenAIServer, Reader]],
    client: TestClient,
    tenant: TenantHandle,
) -> None:
    from tests.integration.test_context_window import _run
    from tests.integration.test_context_window import _submit as submit_reader
    from workers.steps.runner import advance

    _, reader = reader_server(40)
    origin = submit_reader(client, tenant, context={"policy": "summarize"})
    assert _run(origin, carried=False) == "succeeded"
    summaries = _get(client, tenant, f"/v1/tasks/{origin}/steps")["summaries"]
    at = summaries[1]["through_step"] + 2  # past the second summary, before the next
    asked, summarized = len(reader.prompts), len(reader.summary_sizes)

    fork = _fork(client, tenant, origin, from_step=at)
    advance(fork["id"], at + 1)

    assert len(reader.prompts) == asked + 1
    assert reader.prompts[-1] == reader.prompts[at]  # as the origin's step at + 1 was sent
    assert len(reader.summary_sizes) == summarized  # no summary written again
    # It keeps the summaries that prompt stood on: not one written later for a later prompt.
    timeline = _get(client, tenant, f"/v1/tasks/{fork['id']}/steps")
    kept = timeline["summaries"]
    assert kept == summaries[: len(kept)]
    assert kept
    assert kept[-1]["content"] in str(reader.prompts[-1])
    assert len(timeline["items"]) == at + 1


def test_a_running_task_forks_from_its_committed_steps_and_is_left_as_it_was(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    failpoint: Callable[[str], None],
    journal: Path,
) -> None:
    from shared.failpoints import InjectedFault
    from workers.steps.runner import advance

    turn = {"tool_calls": [{"name": "upsert_record", "arguments": {"key": "k"}}]}
    origin = _submit(client, tenant, scripted_task([turn, turn, turn], agent="ops"))
    advance(origin, 1)
    advance(origin, 2)
    failpoint("after_model_commit=raise")  # step 3's answer committed, its tool not yet run
    with pytest.raises(InjectedFault):
        advance(origin, 3)
    failpoint("")
    running = _get(client, tenant, f"/v1/tasks/{origin}")
    steps = _get(client, tenant, f"/v1/tasks/{origin}/steps")
    assert (running["status"], [s["status"] for s in steps["items"]]) == (
        "running",
        ["completed", "completed", "model_responded"],
    )

    refused = client.post(f"/v1/tasks/{origin}/fork", json={"from_step": 3}, headers=tenant.headers)
    assert refused.status_code == 422, refused.text
    fork = _fork(client, tenant, origin, from_step=2)
    assert drive(fork["id"]) == "succeeded"

    assert _effects(journal) == [
        f"upsert {origin}:1-0",
        f"upsert {origin}:2-0",
        f"upsert {fork['id']}:3-0",
    ]
    assert _get(client, tenant, f"/v1/tasks/{origin}/steps") == steps
    assert _get(client, tenant, f"/v1/tasks/{origin}") == running


@pytest.mark.backends("postgresql")
def test_the_dispatcher_sends_a_forks_first_message_for_the_step_after_the_fork_point(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    queue: redis.Redis,
) -> None:
    from tests.helpers import admit
    from tests.integration.test_admission_messages import steps_of

    origin = _waits_at_step_3(client, tenant, drive)
    fork = _fork(client, tenant, origin, from_step=2)
    admit()
    assert (fork["id"], 3) in steps_of(queue)


def test_a_replaced_input_comes_before_the_kept_steps(
    client: TestClient,
    tenant: TenantHandle,
    openai_provider: OpenAIServer,
    drive: Callable[..., str],
) -> None:
    server = openai_provider
    origin = _four_steps(client, tenant, server, drive)
    step_2_prompt = server.requests[1].messages
    server.reply(answer("sent to the other team"))

    fork = _fork(client, tenant, origin, from_step=1, input="send the reports to the other team")
    assert fork["forked_from"]["replaced_input"] is True
    assert drive(fork["id"]) == "succeeded"

    prompt = server.requests[4].messages
    assert prompt[1] == {"role": "user", "content": "send the reports to the other team"}
    assert [prompt[0], *prompt[2:]] == [step_2_prompt[0], *step_2_prompt[2:]]
    assert _get(client, tenant, f"/v1/tasks/{origin}")["steps"] == 4


def test_a_fork_runs_its_origins_agent_version_unless_it_changes_the_tools(
    client: TestClient, tenant: TenantHandle, drive: Callable[..., str]
) -> None:
    origin = _submit(client, tenant, scripted_task([{"content": "done"}]))
    assert drive(origin) == "succeeded"
    with transaction() as session:  # as if a deploy since had changed the agent
        task = session.get(Task, origin)
        assert task is not None
        assert task.agent_version is not None
        task.agent_version = "0" * 64
    assert _fork(client, tenant, origin, from_step=0)["agent_version"] == "0" * 64
    changed = _fork(client, tenant, origin, from_step=0, tools=["calculator"])
    assert changed["agent_version"] not in (None, "0" * 64)  # the agent as it is now
