"""The commands that talk to a running server over HTTP (RATCHET_URL, RATCHET_KEY): ``submit``,
``tail``, ``approve`` and ``ratchet tasks get|list|cancel|retry``. They read no settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ratchet.console import api_client, err, fail, print_json
from shared.statuses import TERMINAL_STATUSES, Decision, TaskStatus

if TYPE_CHECKING:
    from ratchet.client import Client, Event

tasks = typer.Typer(no_args_is_help=True, help="Read and act on tasks over HTTP.")
DATA_COLUMN = " " * 28  # the width of an event line's seq and type
DECIDED = {Decision.APPROVE: "approved", Decision.EDIT: "edited", Decision.REJECT: "rejected"}


def tail(task_id: str, after: int = 0) -> None:
    """Print a task's events as they happen (RATCHET_URL, RATCHET_KEY), until it ends: one
    line each, and under a wait for approval or on durable waits a line per waiting call."""
    with api_client() as client:
        client.get(task_id)  # a wrong id or a server that is down: say so now, not after retries
        for event in client.events(task_id, after=after):
            for line in format_event(event):
                typer.echo(line)


def format_event(event: Event) -> list[str]:
    """An event as ``tail`` prints it: ``seq type data``. A wait for approval or on durable
    waits, a decision and a settled wait are told in words (with the command that decides or
    completes each waiting call); the rest is JSON."""
    head = f"{event.seq:>4} {event.type:<22} "
    data = event.data
    if event.type == "task.awaiting_approval":
        pending = data.get("pending_approval") or {}
        calls = pending.get("calls", [])
        summary = f"step {pending.get('step')}: {len(calls)} call(s) wait for a decision"
        return [head + summary, *(DATA_COLUMN + format_waiting_call(data["id"], c) for c in calls)]
    if event.type == "step.tool_call" and data.get("decision"):
        return [head + format_decision(data)]
    if event.type == "task.waiting":
        waiting = data.get("waiting") or {}
        waits = waiting.get("waits", [])
        summary = f"step {waiting.get('step')}: {len(waits)} call(s) wait"
        return [head + summary, *(DATA_COLUMN + format_wait(data["id"], w) for w in waits)]
    if event.type == "wait.settled":
        return [head + format_settled(data)]
    return [head + json.dumps(data)]


def format_waiting_call(task_id: str, call: dict[str, Any]) -> str:
    return (
        f"call {call['call_id']} {call['tool']} {json.dumps(call['arguments'])}, decide by "
        f"{call['deadline']} (else {call['on_timeout']}): "
        f"ratchet approve {task_id} {call['call_id']} [--reject | --edit JSON]"
    )


def format_wait(task_id: str, wait: dict[str, Any]) -> str:
    """A call a waiting task waits on: its child task, or what the outside world is asked
    for with the command that completes it."""
    head = f"call {wait['call_id']} {wait.get('tool') or ''}".rstrip()
    if wait["kind"] == "child":
        return f"{head} waits for its sub-agent task {wait['child_id']}: ratchet children {task_id}"
    deadline = f", complete by {wait['deadline']} (else {wait['on_timeout']})"
    return (
        f"{head} {json.dumps(wait.get('request'))}{deadline if wait.get('deadline') else ''}: "
        f"{complete_command(wait['token'])}"
    )


def complete_command(token: str) -> str:
    return f"ratchet complete-wait {token} [JSON | --text TEXT]"


def format_settled(data: dict[str, Any]) -> str:
    """A settled wait in words: whose, how, by whom."""
    what = f"sub-agent task {data['child_id']}" if data["kind"] == "child" else data["token"]
    told = f"call {data['call_id']}: {what} {data['status']}"
    if data.get("settled_by") and data["kind"] != "child":
        told += f" by {data['settled_by']}"
    return f"{told}: {data['error']}" if data.get("error") else told


def format_decision(data: dict[str, Any]) -> str:
    verb = DECIDED.get(data["decision"], data["decision"])
    told = f"call {data['call_id']} {data['name']} {verb} by {data['decided_by']}"
    if data["decision"] == Decision.EDIT:
        told += f" to {json.dumps(data['arguments'])}"
    return f"{told}: {data['reason']}" if data.get("reason") else told


def approve(
    task_id: str,
    call_id: str,
    reject: Annotated[bool, typer.Option("--reject", help="reject it: it never runs")] = False,
    edit: Annotated[
        str | None,
        typer.Option(metavar="JSON", help="run it with these arguments (a JSON object)"),
    ] = None,
    reason: Annotated[str | None, typer.Option(help="why; the model reads it")] = None,
) -> None:
    """Approve a tool call that waits for a decision, or --reject it, or --edit its arguments,
    over HTTP (RATCHET_URL, RATCHET_KEY); print the decision as JSON."""
    if reject and edit is not None:
        raise fail("--reject and --edit are mutually exclusive")
    arguments = parse_arguments(edit) if edit is not None else None
    choice = (
        Decision.REJECT if reject else Decision.EDIT if arguments is not None else Decision.APPROVE
    )
    with api_client() as client:
        print_json(
            client.approve(task_id, call_id, decision=choice, arguments=arguments, reason=reason)
        )


def parse_arguments(text: str) -> dict[str, Any]:
    try:
        arguments = json.loads(text)
    except ValueError as exc:
        raise fail(f"--edit is not JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise fail("--edit takes a JSON object: the arguments to run the call with")
    return arguments


def submit(
    input: Annotated[str, typer.Option("--input", "-i", help="the task's input text")],
    agent: str = "default",
    model: str | None = None,
    script: Annotated[
        Path | None,
        typer.Option(
            help='JSON file: the scripted model\'s turns, a list or {"script": [...]}',
        ),
    ] = None,
    tool: Annotated[list[str] | None, typer.Option(help="restrict to these tools")] = None,
    max_steps: int | None = None,
    wait: Annotated[
        bool,
        typer.Option(help="wait for the task to finish (its id goes to stderr at once)"),
    ] = False,
) -> None:
    """Submit a task over HTTP (RATCHET_URL, RATCHET_KEY) and print it as JSON."""
    body: dict[str, Any] = {"agent": agent, "input": input}
    if model:
        body["model"] = model
    if script:
        body["model_options"] = {"script": read_script(script)}
    if tool:
        body["tools"] = tool
    if max_steps:
        body["max_steps"] = max_steps
    with api_client() as client:
        task = client.submit(body)
        if wait:
            task = wait_for(client, task)
    print_json(task)
    if wait and task["status"] != TaskStatus.SUCCEEDED:
        raise typer.Exit(1)


def read_script(path: Path) -> list[Any]:
    """The scripted model's turns from ``path``: a JSON list, or an object whose ``script``
    is one. Anything else is one line naming the file and what is wrong with it."""
    try:
        document = json.loads(path.read_text())
    except OSError as exc:
        raise fail(f"--script {path}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise fail(f"--script {path}: not JSON: {exc}") from None
    turns = document.get("script") if isinstance(document, dict) else document
    if not isinstance(turns, list):
        raise fail(
            f'--script {path}: expected a JSON list of turns, or an object with a "script" '
            f"list (found {_shape(document)})"
        )
    return turns


def _shape(document: Any) -> str:
    if isinstance(document, dict):
        return f"an object with keys {', '.join(map(repr, document)) or 'none'}"
    return f"a JSON {type(document).__name__}"


def wait_for(client: Client, task: dict[str, Any]) -> dict[str, Any]:
    """Long-poll until the task ends. Its id is on stderr first, so an interrupted wait
    (Ctrl-C) leaves the user the task, which goes on, and the command that follows it."""
    task_id = task["id"]
    err(f"submitted task {task_id}; waiting for it to finish")
    try:
        while task["status"] not in TERMINAL_STATUSES:
            task = client.get(task_id, wait=30)
    except KeyboardInterrupt:
        err(f"stopped waiting; task {task_id} goes on. Follow it with: ratchet tail {task_id}")
        raise typer.Exit(130) from None
    return task


@tasks.command("get")
def tasks_get(
    task_id: str,
    wait: Annotated[int, typer.Option(help="long-poll up to N s (≤ 60) for a terminal state")] = 0,
) -> None:
    """Print a task as JSON."""
    with api_client() as client:
        print_json(client.get(task_id, wait=wait or None))


@tasks.command("list")
def tasks_list(
    status: Annotated[str | None, typer.Option(help="only tasks in this state")] = None,
    agent: Annotated[str | None, typer.Option(help="only tasks of this agent")] = None,
    limit: int = 50,
    cursor: Annotated[str | None, typer.Option(help="next_cursor of the previous page")] = None,
) -> None:
    """Print a page of tasks, newest first, as JSON: {"items": [...], "next_cursor": ...}."""
    with api_client() as client:
        print_json(client.list_tasks(status=status, agent=agent, limit=limit, cursor=cursor))


@tasks.command("cancel")
def tasks_cancel(task_id: str) -> None:
    """Ask for the task to be cancelled (a step in flight stops at once); print it."""
    with api_client() as client:
        print_json(client.cancel(task_id))


@tasks.command("retry")
def tasks_retry(task_id: str) -> None:
    """Resume a failed task from its last committed step; print it."""
    with api_client() as client:
        print_json(client.retry(task_id))
