"""Sub-agents and durable waits from the Python client and the command line, against a running
API and worker: a task's children (every page), a wait read and completed once (by key and
by its signed URL, with no key), ``ratchet children`` printing the tree, ``ratchet
complete-wait`` completing once (a second time is one line and exit status 1), and ``ratchet
tail`` telling the wait (with the command that completes it) and its settling in words. A
test reaches a wait by following the task's events to ``task.waiting``, never by sleeping."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from ratchet.client import Client, RatchetAPIError
from tests.e2e.conftest import Run, Stack, free_port, module_stack_fixture, run_ratchet
from tests.e2e.test_cli import assert_one_line_error
from tests.helpers import scripted_task, tool_turn

CI = tool_turn("await_ci", run="build-7")
THREE = {
    "tool_calls": [{"name": "researcher", "arguments": {"task": f"question {i}"}} for i in range(3)]
}
LINKS = {
    "RATCHET_APPROVAL_LINK_SECRET": "l" * 40,
    "RATCHET_PUBLIC_URL": "https://ratchet.example",
}


# One API and one worker for the module's tests (none of them stops a process), with signed
# wait URLs on.
module_stack = module_stack_fixture("waits-cli", LINKS)


@pytest.fixture
def ratchet(tmp_path: Path) -> Run:
    """Run ``python -m ratchet ARGS`` with ``env`` (RATCHET_URL, RATCHET_KEY) added, and no
    RATCHET_KEY of this process's own (a signed URL needs none)."""

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return run_ratchet(*args, env={"RATCHET_KEY": None, **(env or {})}, cwd=tmp_path)

    return run


def parked(client: Client, script: list[dict[str, Any]], agent: str = "lead") -> dict[str, Any]:
    """Submit a task and return it as its ``task.waiting`` event tells it."""
    task = client.submit(scripted_task(script, agent=agent))
    for event in client.events(task["id"]):
        if event.type == "task.waiting":
            return event.data
    raise AssertionError(f"task {task['id']} ended without waiting")


def the_wait(task: dict[str, Any]) -> dict[str, Any]:
    [wait] = task["waiting"]["waits"]
    return dict(wait)


def on_stack(url: str, fleet: Stack) -> str:
    """A signed URL made for the public address, sent to this stack instead."""
    parts = urlsplit(url)
    return f"{fleet.url}{parts.path}?{parts.query}"


# --- the Python client -------------------------------------------------------------------------


def test_the_client_lists_every_child_page_by_page(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Client, "CHILDREN_PAGE", 1)  # children() follows every page
    parent = client.submit(scripted_task([THREE, {"content": "all three"}], agent="lead"))
    assert client.wait(parent["id"], timeout=60)["status"] == "succeeded"

    kids = client.children(parent["id"])

    assert len(kids) == 3
    assert {k["parent_id"] for k in kids} == {parent["id"]}
    assert {(k["agent"], k["status"]) for k in kids} == {("researcher", "succeeded")}
    assert [k["id"] for k in kids] == sorted(k["id"] for k in kids)  # in the order they started
    assert client.children(kids[0]["id"]) == []


def test_the_client_completes_a_wait_once_and_reads_it(client: Client) -> None:
    task = parked(client, [CI, {"content": "CI done"}])
    wait = the_wait(task)
    assert client.get_wait(wait["token"])["status"] == "pending"
    assert client.get_wait(wait["token"])["request"] == {"run": "build-7"}

    done = client.complete_wait(wait["token"], {"passed": True})

    assert (done["status"], done["result"]) == ("completed", {"passed": True})
    with pytest.raises(RatchetAPIError) as again:
        client.complete_wait(wait["token"], {"passed": False})
    assert again.value.status == 409
    assert client.wait(task["id"], timeout=60)["status"] == "succeeded"
    assert client.get_wait(wait["token"])["result"] == {"passed": True}


def test_a_signed_url_completes_a_wait_without_a_key(client: Client, fleet: Stack) -> None:
    task = parked(client, [CI, {"content": "CI done"}])
    url = on_stack(the_wait(task)["url"], fleet)

    done = Client.complete_wait_url(url, "green")

    assert (done["status"], done["result"], done["settled_by"]) == (
        "completed",
        "green",
        "signed link",
    )
    with pytest.raises(RatchetAPIError) as again:
        Client.complete_wait_url(url, "red")
    assert again.value.status == 409
    with pytest.raises(RatchetAPIError) as forged:
        Client.complete_wait_url(url.replace("signature=", "signature=x"), "red")
    assert forged.value.status == 404
    assert client.wait(task["id"], timeout=60)["status"] == "succeeded"


# --- ratchet children, complete-wait and tail ----------------------------------------------------


def test_children_prints_the_task_and_its_children_indented(
    ratchet: Run, client: Client, user: dict[str, str]
) -> None:
    parent = client.submit(scripted_task([THREE, {"content": "all three"}], agent="lead"))
    assert client.wait(parent["id"], timeout=60)["status"] == "succeeded"
    kids = client.children(parent["id"])

    shown = ratchet("children", parent["id"], env=user)

    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith(f"{parent['id']}  succeeded")
    assert " lead " in lines[0]
    for line, kid in zip(lines[1:], kids, strict=True):
        assert line.startswith(f"  {kid['id']}  succeeded")
        assert " researcher " in line
        assert (
            f"{kid['usage']['input_tokens']:,} in / {kid['usage']['output_tokens']:,} out" in line
        )
    assert_one_line_error(ratchet("children", "no-such-task", env=user), "404")


def test_complete_wait_prints_the_wait_and_a_second_completion_is_one_line(
    ratchet: Run, client: Client, user: dict[str, str]
) -> None:
    ask = tool_turn("ask_user", question="Staging or production?")
    task = parked(client, [ask, {"content": "deployed"}], agent="default")
    token = the_wait(task)["token"]

    done = ratchet("complete-wait", token, "--text", "staging", env=user)

    assert done.returncode == 0, done.stderr
    wait = json.loads(done.stdout)
    assert (wait["status"], wait["result"]) == ("completed", "staging")
    again = ratchet("complete-wait", token, '{"env": "production"}', env=user)
    assert again.returncode == 1
    assert_one_line_error(again, "not completed", "already settled")
    assert client.wait(task["id"], timeout=60)["status"] == "succeeded"
    [call] = [c for step in client.steps(task["id"]) for c in step["tool_calls"]]
    assert call["result"] == "staging"


def test_complete_wait_takes_a_signed_url_without_a_key(
    ratchet: Run, client: Client, fleet: Stack
) -> None:
    task = parked(client, [CI, {"content": "CI done"}])
    url = on_stack(the_wait(task)["url"], fleet)

    done = ratchet("complete-wait", url, '{"passed": true}')  # no RATCHET_KEY

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["result"] == {"passed": True}
    assert client.wait(task["id"], timeout=60)["status"] == "succeeded"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((), ("JSON", "--text")),
        (("{}", "--text", "x"), ("one of them",)),
        (("{not json",), ("not JSON", "--text")),
    ],
)
def test_a_bad_result_is_one_line(
    ratchet: Run, args: tuple[str, ...], words: tuple[str, ...]
) -> None:
    down = {"RATCHET_URL": f"http://127.0.0.1:{free_port()}", "RATCHET_KEY": "rk_" + "x" * 43}

    result = ratchet("complete-wait", "wt_token", *args, env=down)

    assert result.returncode == 2
    assert_one_line_error(result, *words)


def test_tail_tells_the_waits_with_the_command_that_completes_each_and_their_settling(
    ratchet: Run, client: Client, user: dict[str, str]
) -> None:
    both = {
        "tool_calls": [
            {"name": "researcher", "arguments": {"task": "look it up"}},
            {"name": "await_ci", "arguments": {"run": "build-8"}},
        ]
    }
    task = parked(client, [both, {"content": "done"}])
    waits = {w["kind"]: w for w in task["waiting"]["waits"]}
    client.complete_wait(waits["token"]["token"], "green")
    assert client.wait(task["id"], timeout=60)["status"] == "succeeded"

    tail = ratchet("tail", task["id"], env=user)  # replays every event, to the end

    assert tail.returncode == 0, tail.stderr
    lines = tail.stdout.splitlines()
    [at] = [i for i, line in enumerate(lines) if line.split()[1] == "task.waiting"]
    assert lines[at].endswith("step 1: 2 call(s) wait")
    told = {line.strip() for line in lines[at + 1 : at + 3]}
    child, token = waits["child"], waits["token"]
    assert told == {
        f"call {child['call_id']} researcher waits for its sub-agent task {child['child_id']}: "
        f"ratchet children {task['id']}",
        f'call {token["call_id"]} await_ci {{"run": "build-8"}}, complete by {token["deadline"]} '
        f"(else fail_call): ratchet complete-wait {token['token']} [JSON | --text TEXT]",
    }
    by = client.get_wait(token["token"])["settled_by"]
    settled = [line.split(None, 2)[2] for line in lines if line.split()[1] == "wait.settled"]
    assert sorted(settled) == sorted(
        [
            f"call {child['call_id']}: sub-agent task {child['child_id']} completed",
            f"call {token['call_id']}: {token['token']} completed by {by}",
        ]
    )
    assert lines[-1].split()[1] == "task.succeeded"
