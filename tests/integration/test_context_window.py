"""A task's prompt stays inside its model's context window, by its context policy, against an
OpenAI-compatible server that measures every prompt it is sent: 200-step tasks under
``truncate`` and ``summarize`` never send one over the window and never separate a tool call
from its result; ``off`` ends with ``context_length_exceeded`` before the provider could
refuse; long tool results are cut in the prompt and kept whole in the ledger."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shared.agents.registry import get_registry
from tests.conftest import Configure, TenantHandle
from tests.fakes.openai_server import OpenAIServer, tool_call
from tests.fakes.reader import Reader, unpaired_calls

MODEL = "openai:reader-small"
WINDOW = 4_000
RESERVE = WINDOW // 4  # RATCHET_CONTEXT_RESERVE_TOKENS (4096) at most a quarter of the window
LONG_TASK = 200


@pytest.fixture
def reader_server(configure: Configure) -> Iterator[Callable[[int], tuple[OpenAIServer, Reader]]]:
    """Start the test server answering as a ``Reader`` of so many pages, with the openai
    provider pointed at it and a window of ``WINDOW`` tokens for ``MODEL``."""
    from workers.providers import _provider

    servers: list[OpenAIServer] = []

    def start(last_page: int) -> tuple[OpenAIServer, Reader]:
        reader = Reader(last_page=last_page)
        server = OpenAIServer(responder=reader).start()
        servers.append(server)
        configure(
            RATCHET_OPENAI_BASE_URL=server.base_url,
            RATCHET_OPENAI_API_KEY="test-key",
            RATCHET_MODEL_CONTEXT_WINDOWS=json.dumps({MODEL: WINDOW}),
            RATCHET_MAX_STEPS_LIMIT="300",
        )
        _provider.cache_clear()  # the provider holds a client built from the old settings
        return server, reader

    yield start
    for server in servers:
        server.close()
    _provider.cache_clear()


def _submit(client: TestClient, tenant: TenantHandle, **body: Any) -> str:
    response = client.post(
        "/v1/tasks",
        json={"input": "Read the book.", "agent": "reader", "model": MODEL, "max_steps": 250}
        | body,
        headers=tenant.headers,
    )
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _run(task_id: str, *, carried: bool) -> str:
    """Run the task's steps in this process: each on its own (the history read back from the
    store), or all on one thread (each step carrying the conversation over to the next)."""
    from shared.store.db import transaction
    from shared.store.tables import Task
    from workers.steps.runner import advance

    for _ in range(LONG_TASK * 2):
        with transaction() as session:
            task = session.get(Task, task_id)
            assert task is not None
            status, step = task.status, task.steps + 1
        if status in ("succeeded", "failed", "cancelled"):
            return status
        advance(task_id, step, go_on=lambda: carried)
    raise AssertionError(f"task {task_id} did not finish")


def _get(client: TestClient, tenant: TenantHandle, path: str) -> Any:
    response = client.get(path, headers=tenant.headers)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.backends("postgresql", "sqlite")
@pytest.mark.parametrize("policy", ["truncate", "summarize"])
def test_a_200_step_task_never_sends_a_prompt_over_the_window(
    policy: str,
    reader_server: Callable[[int], tuple[OpenAIServer, Reader]],
    client: TestClient,
    tenant: TenantHandle,
) -> None:
    _server, reader = reader_server(LONG_TASK - 1)
    task_id = _submit(client, tenant, context={"policy": policy})

    assert _run(task_id, carried=True) == "succeeded"

    assert len(reader.sizes) == LONG_TASK
    assert max(reader.sizes) + RESERVE <= WINDOW, max(reader.sizes)
    assert max(reader.summary_sizes, default=0) <= WINDOW
    for prompt in reader.prompts:
        assert unpaired_calls(prompt) == []
        assert prompt[:2] == reader.prompts[0][:2]  # the system prompt and the task's input
    # The conversation outgrew the window many times over: what was kept is linear in steps.
    whole = sum(len(json.dumps(m)) for m in reader.prompts[-1]) * LONG_TASK
    assert sum(reader.sizes) < LONG_TASK * WINDOW < whole
    task = _get(client, tenant, f"/v1/tasks/{task_id}")
    timeline = _get(client, tenant, f"/v1/tasks/{task_id}/steps?limit=200")
    assert [s["usage"]["prompt_tokens"] for s in timeline["items"]] == reader.sizes
    summaries = timeline["summaries"]
    if policy == "truncate":
        assert reader.summary_sizes == []
        assert summaries == []
        assert any("left out here" in str(m["content"]) for m in reader.prompts[-1])
    else:
        assert len(summaries) == len(reader.summary_sizes) > 1
        assert [s["number"] for s in summaries] == list(range(1, len(summaries) + 1))
        throughs = [s["through_step"] for s in summaries]
        assert throughs == sorted(set(throughs))
        # Each summary builds on the one before, and the prompts carry the newest.
        assert summaries[-1]["content"] in str(reader.prompts[-1])
        step_input = sum(s["usage"]["input_tokens"] for s in timeline["items"])
        summary_input = sum(s["usage"]["input_tokens"] for s in summaries)
        assert summary_input == sum(reader.summary_sizes)
        assert task["usage"]["input_tokens"] == step_input + summary_input


@pytest.mark.parametrize("policy", ["truncate", "summarize"])
def test_carried_and_reread_histories_send_the_same_prompts(
    policy: str,
    reader_server: Callable[[int], tuple[OpenAIServer, Reader]],
    client: TestClient,
    tenant: TenantHandle,
) -> None:
    """The fast path (a step that follows another on the same thread does not read the
    history back) sends what a step that reads it back from the store sends."""
    _, carried = reader_server(40)
    assert _run(_submit(client, tenant, context={"policy": policy}), carried=True) == "succeeded"
    _, reread = reader_server(40)
    assert _run(_submit(client, tenant, context={"policy": policy}), carried=False) == "succeeded"

    assert reread.prompts == carried.prompts
    assert reread.summary_sizes == carried.summary_sizes


def test_off_fails_with_context_length_exceeded_instead_of_sending_it(
    reader_server: Callable[[int], tuple[OpenAIServer, Reader]],
    client: TestClient,
    tenant: TenantHandle,
) -> None:
    _, reader = reader_server(LONG_TASK - 1)
    task_id = _submit(client, tenant, context={"policy": "off"})

    assert _run(task_id, carried=False) == "failed"

    task = _get(client, tenant, f"/v1/tasks/{task_id}")
    assert task["error"]["type"] == "context_length_exceeded", task["error"]
    assert "context window of openai:reader-small (4000 tokens)" in task["error"]["message"]
    assert 1 < len(reader.sizes) < 20
    assert max(reader.sizes) + RESERVE <= WINDOW


def test_a_long_tool_result_is_cut_in_the_prompt_and_kept_whole_in_the_ledger(
    reader_server: Callable[[int], tuple[OpenAIServer, Reader]],
    client: TestClient,
    tenant: TenantHandle,
    configure: Configure,
) -> None:
    server, _reader = reader_server(0)
    configure(RATCHET_TOOL_RESULT_MAX_CHARS="500")
    server.reply(
        tool_call("read_archive", {"megabytes": 1}, call_id="call_archive"),
        tool_call("read_page", {"number": 1}, call_id="call_page"),
    )
    task_id = _submit(client, tenant, model="openai:gpt-4o-mini")

    assert _run(task_id, carried=False) == "succeeded"

    archive, page = (m for m in server.requests[-1].messages if m["role"] == "tool")
    # The tool's own max_result_chars (2,000) wins over the setting; the setting cuts the rest.
    assert 2_000 < len(archive["content"]) < 2_200
    assert "characters cut out here" in archive["content"]
    assert archive["content"].startswith("archive archive")
    assert 500 < len(page["content"]) < 700
    assert "characters cut out here" in page["content"]
    [step] = list(_get(client, tenant, f"/v1/tasks/{task_id}/steps")["items"][:1])
    [call] = step["tool_calls"]
    assert len(call["result"]) == 8 * 131_072  # the ledger holds it whole


@pytest.mark.parametrize(
    ("context", "field"),
    [
        ({"policy": "squash"}, "context.policy"),
        ({"policy": "summarize", "model": "nowhere:model"}, "context.model"),
        ({"policy": "summarize", "model": "anthropic:claude-3-5-haiku"}, "context.model"),
        ({"reserve_tokens": WINDOW}, "context.reserve_tokens"),
        ({"reserve_tokens": 0}, "context.reserve_tokens"),
        ({"policy": "truncate", "keep": 3}, "context.keep"),
    ],
)
def test_a_bad_context_policy_is_a_422_that_changes_nothing(
    context: dict[str, Any],
    field: str,
    reader_server: Callable[[int], tuple[OpenAIServer, Reader]],
    client: TestClient,
    tenant: TenantHandle,
    configure: Configure,
) -> None:
    reader_server(1)
    configure(RATCHET_ANTHROPIC_API_KEY=None, RATCHET_ANTHROPIC_BASE_URL=None)
    response = client.post(
        "/v1/tasks",
        json={"input": "Read.", "agent": "reader", "model": MODEL, "context": context},
        headers=tenant.headers,
    )
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert field in {e["field"] for e in response.json()["errors"]}, response.json()
    listed = _get(client, tenant, "/v1/tasks")
    assert listed["items"] == []


TERSE = {"policy": "off", "reserve_tokens": 1_000}


def test_the_policy_is_stored_resolved(
    reader_server: Callable[[int], tuple[OpenAIServer, Reader]],
    client: TestClient,
    tenant: TenantHandle,
    configure: Configure,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each field of the task's own policy, else of its agent's, else the server's."""
    from shared.store.db import transaction
    from shared.store.tables import Task

    reader_server(1)
    configure(RATCHET_CONTEXT_POLICY="summarize")
    registry = get_registry()
    reader = registry.agents["reader"]
    agents = {**registry.agents, "terse": replace(reader, name="terse", context=TERSE)}
    monkeypatch.setattr(registry, "agents", agents)
    default = _submit(client, tenant)
    own = _submit(client, tenant, context={"policy": "truncate", "reserve_tokens": 500})
    agents_own = _submit(client, tenant, agent="terse")
    mixed = _submit(client, tenant, agent="terse", context={"reserve_tokens": 300})
    with transaction() as session:
        stored = {t: session.get(Task, t).context for t in (default, own, agents_own, mixed)}  # type: ignore[union-attr]
    assert stored == {
        default: {"policy": "summarize"},  # the server's
        own: {"policy": "truncate", "reserve_tokens": 500},  # the task's
        agents_own: TERSE,  # the agent's
        mixed: TERSE | {"reserve_tokens": 300},  # the task's fields over the agent's
    }


def test_the_dashboard_shows_the_summaries_and_each_steps_prompt(
    reader_server: Callable[[int], tuple[OpenAIServer, Reader]],
    client: TestClient,
    make_tenant: Callable[..., TenantHandle],
) -> None:
    from tests.integration.test_dashboard import login

    _, reader = reader_server(30)
    admin = make_tenant(("admin", "tasks:read", "tasks:write"))
    task_id = _submit(client, admin, context={"policy": "summarize"})
    assert _run(task_id, carried=True) == "succeeded"
    login(client, admin.key)
    page = client.get(f"/dashboard/tasks/{task_id}").text
    assert reader.summary_sizes
    for number in range(1, len(reader.summary_sizes) + 1):
        assert f"Summary {number}: the agent is reading the book." in page
    assert f"prompt {reader.sizes[-1]:,} tokens" in page


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("This model's maximum context length is 4096 tokens.", "context_length_exceeded"),
        ("prompt is too long: 210000 tokens > 200000 maximum", None),
    ],
)
def test_a_provider_that_refuses_a_prompt_as_too_long_ends_the_task_as_such(
    message: str,
    code: str | None,
    reader_server: Callable[[int], tuple[OpenAIServer, Reader]],
    client: TestClient,
    tenant: TenantHandle,
) -> None:
    """A window set larger than the model's real one: the provider's 400 is the error the
    policy would have given, with what to set."""
    from tests.fakes.openai_server import error

    server, _ = reader_server(5)
    body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    server.reply(error(400, message, body=body))
    task_id = _submit(client, tenant, context={"policy": "truncate"})

    assert _run(task_id, carried=False) == "failed"

    failure = _get(client, tenant, f"/v1/tasks/{task_id}")["error"]
    assert failure["type"] == "context_length_exceeded", failure
    assert message in failure["message"]
    assert "RATCHET_MODEL_CONTEXT_WINDOWS" in failure["message"]


def test_a_summarizing_model_with_a_smaller_window_summarizes_in_turn_and_skips_no_step(
    reader_server: Callable[[int], tuple[OpenAIServer, Reader]],
    client: TestClient,
    tenant: TenantHandle,
    configure: Configure,
) -> None:
    """A cheaper model named by the policy, whose window takes fewer turns than are due: each
    summary starts where the one before stopped, and the turns it could not take stay."""
    _, reader = reader_server(60)
    windows = {MODEL: WINDOW, "openai:reader-tiny": 2_000}
    configure(RATCHET_MODEL_CONTEXT_WINDOWS=json.dumps(windows))
    policy = {"policy": "summarize", "model": "openai:reader-tiny"}
    task_id = _submit(client, tenant, context=policy)

    assert _run(task_id, carried=True) == "succeeded"

    summaries = _get(client, tenant, f"/v1/tasks/{task_id}/steps")["summaries"]
    assert {s["model"] for s in summaries} == {"openai:reader-tiny"}
    assert max(reader.summary_sizes) <= 2_000
    assert max(reader.sizes) + RESERVE <= WINDOW
    ranges = [
        tuple(int(n) for n in re.findall(r"to add \(step (\d+) to step (\d+)\)", str(p))[0])
        for p in reader.summary_prompts
    ]
    assert ranges[0][0] == 1
    for (_, last), (first, _) in itertools.pairwise(ranges):
        assert first == last + 1  # no step left out between two summaries
    assert [s["through_step"] for s in summaries] == [last for _, last in ranges]
    # Every prompt goes on right after its summary's last step: no turn left out unsummarized.
    for prompt in reader.prompts:
        for index, message in enumerate(prompt[:-1]):
            found = re.match(
                r"\[Summary of this conversation through step (\d+)", message["content"] or ""
            )
            if found:
                [call] = prompt[index + 1]["tool_calls"]
                assert call["id"] == f"call_page_{int(found.group(1)) + 1}"
