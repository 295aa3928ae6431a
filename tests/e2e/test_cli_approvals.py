"""Deciding a tool call that waits for a person, from the Python client and from ``ratchet
approve``, against a running API and worker; and ``ratchet tail`` telling the wait (with the
command that decides it) and the decision. A test reaches the wait by following the task's
events to ``task.awaiting_approval``, never by sleeping."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from ratchet.client import Client, RatchetAPIError
from tests.e2e.conftest import Run, free_port, module_stack_fixture
from tests.e2e.test_cli import assert_one_line_error
from tests.helpers import scripted_task, tool_turn

WIRE = tool_turn("wire_money", to="alice", amount=900)  # always waits for a decision


# One API and one worker for the module's tests (none of them stops a process).
module_stack = module_stack_fixture("approvals")


def waiting_task(client: Client) -> dict[str, Any]:
    """Submit a task whose first call waits, and return it as its wait's event tells it."""
    task = client.submit(scripted_task([WIRE, {"content": "done"}], agent="ops"))
    for event in client.events(task["id"]):
        if event.type == "task.awaiting_approval":
            return event.data
    raise AssertionError(f"task {task['id']} ended without waiting for a decision")


def decision_of(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    decided: dict[str, Any] = json.loads(result.stdout)
    return decided


def tool_call(client: Client, task_id: str) -> dict[str, Any]:
    """The task's one tool call, as its timeline shows it."""
    [call] = [c for step in client.steps(task_id) for c in step["tool_calls"]]
    return dict(call)


# --- the Python client -------------------------------------------------------------------------


def test_the_client_approves_once_and_a_different_decision_is_a_conflict(
    client: Client,
) -> None:
    task = waiting_task(client)
    [call] = task["pending_approval"]["calls"]
    assert (call["call_id"], call["tool"]) == ("1-0", "wire_money")

    approved = client.approve(task["id"], "1-0", reason="looks right")

    assert (approved["decision"], approved["reason"], approved["replayed"]) == (
        "approve",
        "looks right",
        False,
    )
    assert approved["decided_by"].startswith("key:")
    assert approved["arguments"] == {"to": "alice", "amount": 900}
    assert client.approve(task["id"], "1-0", reason="looks right")["replayed"] is True
    with pytest.raises(RatchetAPIError) as conflict:
        client.reject(task["id"], "1-0", reason="changed my mind")
    assert conflict.value.status == 409
    assert client.wait(task["id"], timeout=60)["status"] == "succeeded"
    assert tool_call(client, task["id"])["result"] == "wired 900 to alice"


def test_the_client_edits_the_arguments_the_call_runs_with(client: Client) -> None:
    task = waiting_task(client)

    with pytest.raises(RatchetAPIError) as bad:
        client.edit(task["id"], "1-0", arguments={"to": "bob"})
    edited = client.edit(task["id"], "1-0", arguments={"to": "bob", "amount": 5})

    assert bad.value.status == 422
    assert edited["decision"] == "edit"
    assert edited["arguments"] == {"to": "bob", "amount": 5}
    assert edited["original_arguments"] == {"to": "alice", "amount": 900}
    assert client.wait(task["id"], timeout=60)["status"] == "succeeded"
    assert tool_call(client, task["id"])["result"] == "wired 5 to bob"


def test_the_client_rejects_and_the_model_reads_why(client: Client) -> None:
    task = waiting_task(client)

    rejected = client.reject(task["id"], "1-0", reason="wrong account")

    assert (rejected["decision"], rejected["reason"]) == ("reject", "wrong account")
    with pytest.raises(RatchetAPIError) as unknown:
        client.approve(task["id"], "9-9")
    assert unknown.value.status == 404
    with pytest.raises(RatchetAPIError) as conflict:
        client.approve(task["id"], "1-0")
    assert conflict.value.status == 409
    assert client.wait(task["id"], timeout=60)["status"] == "succeeded"
    told = tool_call(client, task["id"])
    assert (told["status"], told["runs"], told["result"]) == ("failed", 0, None)
    assert "wrong account" in told["error"]  # what the model read


# --- ratchet approve and ratchet tail ----------------------------------------------------------


def test_approve_prints_the_decision_and_a_conflict_is_one_line(
    ratchet: Run, client: Client, user: dict[str, str]
) -> None:
    task = waiting_task(client)

    approved = decision_of(ratchet("approve", task["id"], "1-0", env=user))

    assert (approved["call_id"], approved["decision"]) == ("1-0", "approve")
    assert approved["task"]["id"] == task["id"]
    assert_one_line_error(ratchet("approve", task["id"], "1-0", "--reject", env=user), "409")
    assert client.wait(task["id"], timeout=60)["status"] == "succeeded"


def test_approve_with_edit_runs_the_call_with_those_arguments(
    ratchet: Run, client: Client, user: dict[str, str]
) -> None:
    task = waiting_task(client)
    arguments = '{"to": "bob", "amount": 5}'

    edited = decision_of(ratchet("approve", task["id"], "1-0", "--edit", arguments, env=user))

    assert (edited["decision"], edited["arguments"]) == ("edit", {"to": "bob", "amount": 5})
    assert client.wait(task["id"], timeout=60)["status"] == "succeeded"
    assert tool_call(client, task["id"])["result"] == "wired 5 to bob"


def test_tail_shows_the_wait_and_the_decision(
    ratchet: Run, client: Client, user: dict[str, str]
) -> None:
    task = waiting_task(client)
    [call] = task["pending_approval"]["calls"]
    reject = ("approve", task["id"], "1-0", "--reject", "--reason", "wrong account")
    rejected = decision_of(ratchet(*reject, env=user))
    assert (rejected["decision"], rejected["reason"]) == ("reject", "wrong account")

    tail = ratchet("tail", task["id"], env=user)  # replays every event, to the end

    assert tail.returncode == 0, tail.stderr
    lines = tail.stdout.splitlines()
    [at] = [i for i, line in enumerate(lines) if line.split()[1] == "task.awaiting_approval"]
    assert lines[at].endswith("step 1: 1 call(s) wait for a decision")
    assert lines[at + 1].strip() == (
        f'call 1-0 wire_money {{"to": "alice", "amount": 900}}, decide by {call["deadline"]} '
        f"(else {call['on_timeout']}): ratchet approve {task['id']} 1-0 [--reject | --edit JSON]"
    )
    told = f"call 1-0 wire_money rejected by {rejected['decided_by']}: wrong account"
    [decided] = [line for line in lines if line.endswith(told)]
    assert decided.split()[1] == "step.tool_call"
    assert lines[-1].split()[1] == "task.succeeded"


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (("--reject", "--edit", "{}"), ("mutually exclusive",)),
        (("--edit", "{not json"), ("--edit", "not JSON")),
        (("--edit", "[1, 2]"), ("--edit", "JSON object")),
    ],
)
def test_bad_flags_are_one_line(
    ratchet: Run, flags: tuple[str, ...], words: tuple[str, ...]
) -> None:
    down = {"RATCHET_URL": f"http://127.0.0.1:{free_port()}", "RATCHET_KEY": "rk_" + "x" * 43}

    assert_one_line_error(ratchet("approve", "some-task", "1-0", *flags, env=down), *words)


def test_an_api_that_is_down_is_one_line(ratchet: Run) -> None:
    down = f"http://127.0.0.1:{free_port()}"

    result = ratchet("approve", "some-task", "1-0", env={"RATCHET_URL": down, "RATCHET_KEY": "k"})

    assert_one_line_error(result, "cannot reach", down)
