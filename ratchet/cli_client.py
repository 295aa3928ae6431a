"""The commands that talk to a running server over HTTP (RATCHET_URL, RATCHET_KEY): ``submit``,
``tail`` and ``ratchet tasks get|list|cancel|retry``. They read no settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from ratchet.console import api_client, print_json

tasks = typer.Typer(no_args_is_help=True, help="Read and act on tasks over HTTP.")


def tail(task_id: str, after: int = 0) -> None:
    """Print a task's events as they happen (RATCHET_URL, RATCHET_KEY), until it ends."""
    with api_client() as client:
        client.get(task_id)  # a wrong id or a server that is down: say so now, not after retries
        for event in client.events(task_id, after=after):
            typer.echo(f"{event.seq:>4} {event.type:<22} {json.dumps(event.data)}")


def submit(
    input: Annotated[str, typer.Option("--input", "-i", help="the task's input text")],
    agent: str = "default",
    model: str | None = None,
    script: Annotated[
        Path | None, typer.Option(help="JSON file: the scripted model's turns")
    ] = None,
    tool: Annotated[list[str] | None, typer.Option(help="restrict to these tools")] = None,
    max_steps: int | None = None,
    wait: Annotated[bool, typer.Option(help="wait for the task to finish")] = False,
) -> None:
    """Submit a task over HTTP (RATCHET_URL, RATCHET_KEY) and print it as JSON."""
    body: dict[str, Any] = {"agent": agent, "input": input}
    if model:
        body["model"] = model
    if script:
        turns = json.loads(script.read_text())
        body["model_options"] = {"script": turns["script"] if isinstance(turns, dict) else turns}
    if tool:
        body["tools"] = tool
    if max_steps:
        body["max_steps"] = max_steps
    with api_client() as client:
        task = client.submit(body)
        while wait and task["status"] not in TERMINAL:
            task = client.get(task["id"], wait=30)
    print_json(task)
    if wait and task["status"] != "succeeded":
        raise typer.Exit(1)


TERMINAL = ("succeeded", "failed", "cancelled")


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
