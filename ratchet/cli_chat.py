"""``ratchet chat``: a conversation with an agent in the terminal, over HTTP (RATCHET_URL,
RATCHET_KEY).

Each line typed is a turn of a thread. The answer is printed as the model writes it (its
``message.delta`` events), tool calls as they are asked for and as they end, and a call that
waits for a person is decided at the prompt. Styles are used only on a terminal: piped, the
output is plain text.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ratchet.cli_client import format_decision, parse_arguments, read_script
from ratchet.console import api_client
from shared.statuses import TERMINAL_STATUSES, Decision

if TYPE_CHECKING:
    from ratchet.client import Client, Event

EXIT_COMMANDS = ("/exit", "/quit")
USER, AGENT = "you> ", "agent> "
CHOICES = {"a": Decision.APPROVE, "r": Decision.REJECT, "e": Decision.EDIT}


def chat(
    agent: Annotated[str, typer.Option(help="the agent of a new thread")] = "default",
    thread: Annotated[
        str | None, typer.Option(metavar="ID", help="resume this thread, showing it so far")
    ] = None,
    model: Annotated[str | None, typer.Option(help="the model of every turn")] = None,
    script: Annotated[
        Path | None,
        typer.Option(help="JSON file: the scripted model's turns, for every turn (demos, tests)"),
    ] = None,
) -> None:
    """Chat with an agent in a thread: each line is a turn, its answer streams as it is
    written. Ctrl-C during an answer cancels the turn; Ctrl-D or /exit quits (resume with
    --thread)."""
    options: dict[str, Any] = {"model": model} if model else {}
    if script:
        options |= {"model": model or "scripted", "model_options": {"script": read_script(script)}}
    _line_editing()
    with api_client() as client:
        opened = client.get_thread(thread) if thread else client.create_thread(agent=agent)
        say(f"thread {opened['id']} ({opened['agent']}); /exit or Ctrl-D to quit", dim=True)
        if thread:
            _show_history(client, opened)
        try:
            while (line := _read_line()) is not None:
                if line:
                    _turn(client, opened["id"], line, options)
        except EOFError:
            pass
        finally:
            say(f"thread {opened['id']}: resume it with ratchet chat --thread {opened['id']}")


def _line_editing() -> None:
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):  # not on every platform
            import readline  # noqa: F401 - line editing and history for input()


def _read_line() -> str | None:
    """The next line typed; None to quit (Ctrl-D, Ctrl-C at the prompt, or /exit)."""
    try:
        line = input(USER).strip()
    except (EOFError, KeyboardInterrupt):
        typer.echo()
        return None
    return None if line in EXIT_COMMANDS else line


def say(text: str, *, dim: bool = False, fg: str | None = None, nl: bool = True) -> None:
    """Print now (never buffered); styles only reach a terminal (click strips them)."""
    typer.echo(typer.style(text, dim=dim or None, fg=fg) if dim or fg else text, nl=nl)
    sys.stdout.flush()


def _show_history(client: Client, opened: dict[str, Any]) -> None:
    """The conversation so far. A turn still unfinished is followed instead (in full)."""
    latest = opened.get("latest_turn")
    unfinished = latest is not None and latest["status"] not in TERMINAL_STATUSES
    for message in client.messages(opened["id"]):
        if not (unfinished and latest is not None and message["turn"] >= latest["turn"]):
            _show_message(message)
    if unfinished and latest is not None:
        say(f"(turn {latest['turn']} is {latest['status']}: following it)", dim=True)
        _follow(client, latest["id"])


def _show_message(message: dict[str, Any]) -> None:
    content = message.get("content")
    text = content if isinstance(content, str) else json.dumps(content)
    if message["role"] == "user":
        say(USER + text)
    elif message["role"] == "tool":
        _show_outcome(message.get("status") or "", message.get("name") or "", content, None)
    else:
        if content:
            say(AGENT + text)
        for call in message.get("tool_calls") or []:
            _show_call(call)


def _show_call(call: dict[str, Any]) -> None:
    say(f"  tool {call['name']} {json.dumps(call.get('arguments'))}", fg="cyan")


def _show_outcome(status: str, name: str, result: Any, error: str | None) -> None:
    told = error if status == "failed" else result
    text = told if isinstance(told, str) else json.dumps(told)
    say(f"  {name} {status}: {text}", fg="red" if status == "failed" else "cyan")


def _turn(client: Client, thread_id: str, line: str, options: dict[str, Any]) -> None:
    """Send the line as a turn and follow it to its end; Ctrl-C cancels it."""
    from ratchet.client import RatchetAPIError

    try:
        task = client.run(thread_id, line, **options)
    except RatchetAPIError as exc:
        say(f"error: {exc}", fg="red")
        return
    try:
        _follow(client, task["id"])
    except KeyboardInterrupt:
        typer.echo()
        client.cancel(task["id"])
        say(f"(turn {task['turn']} cancelled; what it committed stays in the thread)", dim=True)
    except RatchetAPIError as exc:
        say(f"error: {exc}", fg="red")


@dataclass
class Answer:
    """What has been printed of the turn's answers: each step's text, and the step whose
    text the line under the cursor continues (0: none)."""

    shown: dict[int, str] = field(default_factory=dict)
    open_step: int = 0

    def write(self, step: int, text: str) -> None:
        if self.open_step != step:
            self.end_line()
            say(AGENT, nl=False)
            self.open_step = step
        say(text, nl=False)
        self.shown[step] = self.shown.get(step, "") + text

    def end_line(self) -> None:
        if self.open_step:
            typer.echo()
            self.open_step = 0

    def discard(self, step: int) -> None:
        if self.shown.pop(step, ""):
            self.end_line()
            say("(that answer was cut off; it is asked again)", dim=True)

    def commit(self, step: int, content: str) -> None:
        """The step's committed answer: what was not shown of it yet (all of it if what was
        shown is not its start)."""
        shown = self.shown.get(step, "")
        if content.startswith(shown):
            if content[len(shown) :]:
                self.write(step, content[len(shown) :])
        else:
            self.end_line()
            self.shown.pop(step, None)
            self.write(step, content)
        self.end_line()


def _follow(client: Client, task_id: str) -> None:
    """Print the task's answer as it is written, its tool calls and outcomes, and ask for
    the decisions it waits for, until it ends."""
    answer = Answer()
    for event in client.events(task_id, deltas=True):
        show_event(client, event, answer)
    answer.end_line()


def show_event(client: Client, event: Event, answer: Answer) -> None:
    data = event.data
    step = int(data.get("step") or 0)
    if event.type == "message.delta" and data.get("text"):
        answer.write(step, data["text"])
    elif event.type == "message.discarded":
        answer.discard(step)
    elif event.type == "step.model_response":
        if data.get("content"):
            answer.commit(step, str(data["content"]))
        for call in data.get("tool_calls") or []:
            _show_call(call)
    elif event.type == "step.tool_call":
        answer.end_line()
        if data.get("decision"):
            say(f"  {format_decision(data)}", dim=True)
        else:
            _show_outcome(data["status"], data["name"], data.get("result"), data.get("error"))
    elif event.type == "task.awaiting_approval":
        answer.end_line()
        for call in (data.get("pending_approval") or {}).get("calls", []):
            _decide(client, data["id"], call)
    elif event.type == "task.failed":
        answer.end_line()
        say(f"error: the turn failed: {data.get('error') or 'no reason given'}", fg="red")
    elif event.type == "task.cancelled":
        answer.end_line()
        say("(the turn was cancelled)", dim=True)


def _decide(client: Client, task_id: str, call: dict[str, Any]) -> None:
    """Ask at the prompt whether the waiting call runs, then send the decision."""
    say(f"  {call['tool']} {json.dumps(call['arguments'])} waits for your decision", fg="yellow")
    while True:
        try:
            choice = input("  [a]pprove, [r]eject or [e]dit? ").strip().lower()[:1]
        except EOFError:  # Ctrl-D: quit; the call waits (resume the thread to decide it)
            typer.echo()
            raise
        if choice not in CHOICES:
            say("  type a, r or e (Ctrl-C to cancel the turn)", dim=True)
            continue
        arguments = _edited(call) if choice == "e" else None
        if choice == "e" and arguments is None:
            continue
        reason = input("  why (the model reads it)? ").strip() if choice == "r" else ""
        client.approve(
            task_id,
            call["call_id"],
            decision=CHOICES[choice],
            arguments=arguments,
            reason=reason or None,
        )
        return


def _edited(call: dict[str, Any]) -> dict[str, Any] | None:
    """New arguments as a JSON object, or None (asked again) if they are not one."""
    text = input(f"  arguments (JSON, were {json.dumps(call['arguments'])}): ")
    try:
        return parse_arguments(text)
    except typer.Exit:  # parse_arguments said what is wrong, on stderr
        return None
