"""The commands of sub-agents and durable waits, over HTTP (RATCHET_URL, RATCHET_KEY):
``ratchet children`` prints a task's tree of sub-agent tasks, ``ratchet complete-wait``
completes what a waiting task waits for. They read no settings."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ratchet.console import api_client, err, fail, print_json

if TYPE_CHECKING:
    from ratchet.client import Client

INDENT = "  "  # per level of the tree
SIGNED_URL = ("http://", "https://")


def children(task_id: str) -> None:
    """Print the task and the tree of sub-agent tasks below it (children, grandchildren, …),
    one line each, indented by depth: id, status, agent and usage (a task's usage counts its
    settled children's)."""
    with api_client() as client:
        task = client.get(task_id)
        for line in tree_lines(client, task):
            typer.echo(line)


def tree_lines(client: Client, task: dict[str, Any], depth: int = 0) -> list[str]:
    """The task's line, then its children's trees a level deeper, in the order they started."""
    lines = [INDENT * depth + format_node(task)]
    for child in client.children(task["id"]):
        lines += tree_lines(client, child, depth + 1)
    return lines


def format_node(task: dict[str, Any]) -> str:
    usage = task.get("usage") or {}
    cost = usage.get("cost_usd")
    spent = f"{usage.get('input_tokens', 0):,} in / {usage.get('output_tokens', 0):,} out, " + (
        "cost unknown" if cost is None else f"${cost:,.4f}"
    )
    return f"{task['id']}  {task['status']:<17} {task['agent']:<16} {spent}"


def complete_wait(
    token: Annotated[str, typer.Argument(help="the wait's token, or its signed URL")],
    result: Annotated[
        str | None,
        typer.Argument(metavar="JSON", help="the result: any JSON value", show_default=False),
    ] = None,
    text: Annotated[
        str | None,
        typer.Option(metavar="TEXT", help="the result is this text (e.g. an answer to ask_user)"),
    ] = None,
) -> None:
    """Complete a durable wait with a JSON value (or --text), which becomes the waiting tool
    call's result; print the wait as JSON. A wait is completed once: one already settled is
    an error and changes nothing. With a signed URL for TOKEN, no API key is needed."""
    from ratchet.client import Client, RatchetAPIError

    payload = parse_result(result, text)
    try:
        if token.startswith(SIGNED_URL):
            wait = Client.complete_wait_url(token, payload)
        else:
            with api_client() as client:
                wait = client.complete_wait(token, payload)
    except RatchetAPIError as exc:
        if exc.status != 409:
            raise
        err(f"error: not completed: {exc.problem.get('detail') or exc}")
        raise typer.Exit(1) from None
    print_json(wait)


def parse_result(result: str | None, text: str | None) -> Any:
    if (result is None) == (text is None):
        raise fail("give the result as JSON or as --text TEXT (one of them)")
    if text is not None:
        return text
    assert result is not None
    try:
        return json.loads(result)
    except ValueError as exc:
        raise fail(
            f"the result is not JSON: {exc} (for plain text, use --text {json.dumps(result)})"
        ) from None
