"""``ratchet batch``: many tasks submitted in one request, and the batch followed, over HTTP
(RATCHET_URL, RATCHET_KEY). They read no settings: the server checks each item."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ratchet.console import api_client, err, fail, print_json
from shared.statuses import TaskStatus

if TYPE_CHECKING:
    from ratchet.client import Client

batch = typer.Typer(
    no_args_is_help=True, help="Submit many tasks in one request, and follow the batch."
)
LONG_POLL_SECONDS = 30


@batch.command("submit")
def batch_submit(
    file: Annotated[
        Path,
        typer.Argument(
            metavar="FILE.jsonl",
            help="one submit body (a JSON object) a line, each with an optional "
            'idempotency_key of its own; "-" reads stdin',
        ),
    ],
    wait: Annotated[
        bool,
        typer.Option(help="wait for every task to end and print the batch (its id goes to stderr)"),
    ] = False,
    idempotency_key: Annotated[
        str | None, typer.Option(help="the same key and file again answers the same batch")
    ] = None,
) -> None:
    """Submit the file's tasks as one batch and print the answer as JSON: an item per line,
    its task_id, or the error that refused it. With --wait, print the batch once all its
    tasks have ended; the exit status is 1 unless every item became a task that succeeded."""
    tasks = read_jsonl(file)
    with api_client() as client:
        submitted = client.submit_batch(tasks, idempotency_key=idempotency_key)
        if not wait:
            print_json(submitted)
            return
        done = wait_for(client, submitted["batch_id"])
    print_json(done)
    succeeded = done["counts"].get(TaskStatus.SUCCEEDED, 0)
    if done["refused_count"] or succeeded != done["task_count"]:
        raise typer.Exit(1)


@batch.command("get")
def batch_get(
    batch_id: str,
    wait: Annotated[
        int, typer.Option(help="long-poll up to N s (≤ 60) for every task to have ended")
    ] = 0,
) -> None:
    """Print the batch as JSON: its tasks' ids and counts by status, and whether all ended."""
    with api_client() as client:
        print_json(client.batch(batch_id, wait=wait or None))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The submit bodies in ``path`` (or stdin for "-"), one JSON object a line; blank lines
    are skipped. Anything else is one line naming the file, the line and what is wrong."""
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
    except OSError as exc:
        raise fail(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:  # not UTF-8
        raise fail(f"{path}: not text: {exc}") from None
    tasks: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            document = json.loads(line)
        except ValueError as exc:
            raise fail(f"{path}:{number}: not JSON: {exc}") from None
        if not isinstance(document, dict):
            raise fail(f"{path}:{number}: expected a JSON object (a submit body)")
        tasks.append(document)
    if not tasks:
        raise fail(f"{path}: no tasks in it (one JSON object a line)")
    return tasks


def wait_for(client: Client, batch_id: str) -> dict[str, Any]:
    """Long-poll until every task of the batch has ended. Its id is on stderr first, so an
    interrupted wait (Ctrl-C) leaves the user the batch, which goes on."""
    err(f"submitted batch {batch_id}; waiting for its tasks to finish")
    try:
        while not (view := client.batch(batch_id, wait=LONG_POLL_SECONDS))["completed"]:
            pass
    except KeyboardInterrupt:
        follow = f"ratchet batch get {batch_id} --wait {LONG_POLL_SECONDS}"
        err(f"stopped waiting; batch {batch_id} goes on. Follow it with: {follow}")
        raise typer.Exit(130) from None
    return view
