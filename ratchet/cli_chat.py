"""``ratchet chat``: a conversation with an agent in the terminal, over HTTP (RATCHET_URL,
RATCHET_KEY).

Each line typed is a turn of a thread. The answer is printed as the model writes it (its
``message.delta`` events), tool calls as they are asked for and as they end, and a call that
waits for a person is decided at the prompt. When the model asks the person a question
(``ask_user``), it is shown and the prompt comes back: the next line is the answer (the API
takes a thread's message as the answer to the question its turn in flight asked), and the
same turn is followed on from where it stopped. Styles are used only on a terminal: piped,
the output is plain text.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ratchet.cli_client import complete_command, format_decision, parse_arguments, read_script
from ratchet.console import api_client
from shared.statuses import TERMINAL_STATUSES, Decision

if TYPE_CHECKING:
    from ratchet.client import Client, Event

EXIT_COMMANDS = ("/exit", "/quit")
USER, AGENT = "you> ", "agent> "
CHOICES = {"a": Decision.APPROVE, "r": Decision.REJECT, "e": Decision.EDIT}
ASK_USER = "ask_user"  # the built-in tool whose question the person answers at the prompt


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
    asked: dict[str, str] = {}  # a turn that asked a question: the last event of it shown
    with api_client() as client:
        opened = client.get_thread(thread) if thread else client.create_thread(agent=agent)
        say(f"thread {opened['id']} ({opened['agent']}); /exit or Ctrl-D to quit", dim=True)
        if thread:
            _show_history(client, opened, asked)
        try:
            while (line := _read_line()) is not None:
                if line:
                    _turn(client, opened["id"], line, options, asked)
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


def _show_history(client: Client, opened: dict[str, Any], asked: dict[str, str]) -> None:
    """The conversation so far. A turn still unfinished is followed instead (in full)."""
    latest = opened.get("latest_turn")
    unfinished = latest is not None and latest["status"] not in TERMINAL_STATUSES
    for message in client.messages(opened["id"]):
        if not (unfinished and latest is not None and message["turn"] >= latest["turn"]):
            _show_message(message)
    if unfinished and latest is not None:
        say(f"(turn {latest['turn']} is {latest['status']}: following it)", dim=True)
        _follow(client, latest["id"], asked)


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


def _turn(
    client: Client, thread_id: str, line: str, options: dict[str, Any], asked: dict[str, str]
) -> None:
    """Send the line as a turn (or, when the turn in flight asked a question, as its answer)
    and follow it to its end, or until it asks; Ctrl-C cancels it."""
    from ratchet.client import RatchetAPIError

    try:
        task = client.run(thread_id, line, **options)
    except RatchetAPIError as exc:
        say(f"error: {exc}", fg="red")
        return
    try:
        _follow(client, task["id"], asked)
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


def _follow(client: Client, task_id: str, asked: dict[str, str]) -> None:
    """Print the task's answer as it is written, its tool calls and outcomes, and ask for
    the decisions it waits for, until it ends or asks the person a question (then
    ``asked`` keeps where it stopped, and the answer's follow goes on from there)."""
    answer = Answer()
    # Left mid-stream when the turn asks: the stream's generator is dropped as this returns,
    # which closes its connection.
    for event in client.events(task_id, after=asked.pop(task_id, 0), deltas=True):
        if show_event(client, event, answer):
            asked[task_id] = event.id
            break
    answer.end_line()


def show_event(client: Client, event: Event, answer: Answer) -> bool:
    """Show one event of a turn; whether the turn now waits for the person's answer to a
    question (the next line typed)."""
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
        _show_tool_call(data)
    elif event.type == "task.waiting":
        answer.end_line()
        return _show_questions((data.get("waiting") or {}).get("waits", []))
    elif event.type == "wait.settled" and data.get("kind") == "child":
        say(f"  sub-agent task {data['child_id']} {data['status']}", dim=True)
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
    return False


def _show_tool_call(data: dict[str, Any]) -> None:
    """A call's decision, its park, or its outcome."""
    if data.get("decision"):
        say(f"  {format_decision(data)}", dim=True)
    elif data["status"] == "waiting":
        _show_parked(data["name"], data.get("wait") or {})
    else:
        _show_outcome(data["status"], data["name"], data.get("result"), data.get("error"))


def _show_parked(name: str, wait: dict[str, Any]) -> None:
    """A call that parked: on its sub-agent task, on a question (shown once the turn waits),
    or on the outside world (with the command that completes it)."""
    if wait.get("kind") == "child":
        say(f"  {name} started sub-agent task {wait['child_id']}", dim=True)
    elif name != ASK_USER and wait.get("token"):
        say(f"  {name} waits: {complete_command(wait['token'])}", dim=True)


def _show_questions(waits: list[dict[str, Any]]) -> bool:
    """Show the questions the turn asks (``ask_user``); whether it asks one."""
    questions = [w for w in waits if w.get("tool") == ASK_USER and w.get("status") == "pending"]
    for wait in questions:
        request = wait.get("request")
        question = request.get("question") if isinstance(request, dict) else request
        say(f"agent asks> {question}", fg="yellow")
    if questions:
        say("(your next line answers it)", dim=True)
    return bool(questions)


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
