"""What a leased step knows: the task as leased, its agent and tools, and the conversation
rebuilt from the task's input and its committed steps (or carried over from the step before)."""

from __future__ import annotations

import collections
import os
import socket
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.agents import versions
from shared.agents.registry import Agent, Tool, get_agent, get_registry
from shared.context_window import Policy, policy_of
from shared.mcp.names import is_mcp_name
from shared.settings import get_settings
from shared.statuses import TERMINAL_STATUSES
from shared.store import checkpoints, ledger, summaries, threads, waits
from shared.store.backends import write_session
from shared.store.leases import Lease
from shared.store.ledger import CallStatus
from shared.store.tables import Step, Summary, Tenant, ToolCall, Wait
from shared.views import TaskState
from workers import step_pool, tool_runner
from workers.providers import ModelResponse
from workers.providers.base import Message
from workers.steps import output, window


def worker_id() -> str:
    """``host:pid:thread``: who holds a lease (the pid is read each time: workers fork)."""
    return f"{_HOST}:{os.getpid()}:{threading.get_ident()}"


_HOST = socket.gethostname()


@dataclass
class Context:
    """What a step needs, read when the lease is taken. ``task`` is the row as this lease
    holder last left it (each write of the step moves it on)."""

    lease: Lease
    task: TaskState
    agent: Agent
    tools: dict[str, Tool]
    history: list[Message]
    step_row: Step | None
    calls: dict[str, ToolCall]
    tenant_name: str
    clock_ms: int
    # Asked when the step completes: whether this thread goes on with the next step (then the
    # completion leases it in the same write).
    go_on: Callable[[], bool] = lambda: False
    # What the model reads back of this step, once it is complete: its answer, then each tool
    # call's outcome (kept for the next step on this thread).
    said: list[Message] = field(default_factory=list)
    outcomes: dict[str, tool_runner.Outcome] = field(default_factory=dict)
    # Calls whose ``started`` row this lease already wrote (with the model's response).
    started: set[str] = field(default_factory=set)
    # Parked calls (workers.steps.parking): the step's waits as read, by call id; the waits
    # this lease parked, as shown; and how many of the answer's calls start sub-agents.
    waits: dict[str, Wait] = field(default_factory=dict)
    parked: dict[str, dict[str, Any]] = field(default_factory=dict)
    subagent_calls: int = 1
    # Held by each write while it reads ``task`` and moves it on: a step's calls may run at
    # once (workers.steps.fan_out), and their writes then take turns.
    writing: threading.Lock = field(default_factory=threading.Lock)
    # This process's monotonic clock just before the step's last write went out: when the lease
    # that a completion takes for the next step began (``leases.next_lease``).
    written_at: float = 0.0


def load_context(session: Session, lease: Lease) -> Context:
    """Everything the step needs, read in the lease's transaction.

    A task's very first lease has no history and nothing to resume: it reads nothing more.
    """
    task = lease.task
    assert task is not None
    fresh = lease.fresh  # never ran: a retried task (attempt 1 again) has rows to resume
    steps, calls = ([], []) if fresh else checkpoints.load_history(session, lease.task_id)
    agent, tools = agent_and_tools(task, session)  # MCP tools: after the transaction
    summary = None if fresh else latest_summary(session, task)
    after = summary.through_step if summary is not None else 0
    done = [s for s in steps if after < s.number < lease.step]
    current = next((s for s in steps if s.number == lease.step), None)
    step_calls = {c.call_id: c for c in calls if c.step_number == lease.step}
    parked = any(c.status == CallStatus.WAITING for c in step_calls.values())
    return Context(
        lease=lease,
        task=task,
        agent=agent,
        tools=tools,
        history=open_conversation(task, agent, earlier=earlier_turns(session, task))
        + summary_messages(summary)
        + step_messages(done, calls, tools=tools),
        step_row=current,
        calls=step_calls,
        tenant_name=tenant_name(task.tenant_id, session),
        clock_ms=lease.clock_ms,
        waits=waits.of_step(session, task.id, lease.step) if parked else {},
    )


def following_context(lease: Lease, history: list[Message]) -> Context:
    """The context of a step leased by its predecessor's completion, from memory: the step
    has no rows yet, and the conversation before it was carried over."""
    task = lease.task
    assert task is not None
    agent, tools = agent_and_tools(task)  # MCP tools: under the step's heartbeat
    return Context(
        lease=lease,
        task=task,
        agent=agent,
        tools=tools,
        history=history,
        step_row=None,
        calls={},
        tenant_name=tenant_name(task.tenant_id),
        clock_ms=lease.clock_ms,
    )


# --- the agent and tools a step runs: its pinned version's (shared.agents.versions) ------------


def agent_and_tools(
    task: TaskState, session: Session | None = None
) -> tuple[Agent, dict[str, Tool]]:
    """The task's agent (what a step reads of it: the system prompt) and Python tools by name,
    as its pinned version defines them: this deployment's code with the version's
    descriptions, schemas and behaviour, a tool the deployment lacks refusing each call with
    a message that says so (``versions.pinned_tools``). A task from before pinning runs the
    live registry's."""
    pinned = _pinned(task, session)
    if pinned is None:
        return get_agent(task.agent), _live_tools(task)
    return pinned.pinned_agent, versions.pinned_tools(pinned, task.tools)


def python_tools(task: TaskState, session: Session | None = None) -> dict[str, Tool]:
    """The task's Python tools by name (see ``agent_and_tools``)."""
    pinned = _pinned(task, session)
    return _live_tools(task) if pinned is None else versions.pinned_tools(pinned, task.tools)


def _live_tools(task: TaskState) -> dict[str, Tool]:
    registry = get_registry()
    return {name: registry.tools[name] for name in task.tools if name in registry.tools}


def _pinned(task: TaskState, session: Session | None) -> versions.Version | None:
    """The task's pinned version, or None where the live registry's agent is that version (no
    deploy changed it since the submission: nothing to read) or the task has none. A version
    is read once per process, in ``session`` if the caller holds one (see ``tenant_name``)."""
    if task.agent_version is None:
        return None
    live = get_registry().agents.get(task.agent)
    if live is not None and versions.version_of(live).id == task.agent_version:
        return None
    found = versions.cached_version(task.agent_version)
    if found is not None:
        return found
    with nullcontext(session) if session is not None else write_session() as reader:
        return versions.load_version(task.agent_version, reader)


# --- end of the pinned agent and tools ---------------------------------------------------------


def task_tools(
    task: TaskState, *, mcp: bool = True, session: Session | None = None
) -> dict[str, Tool]:
    """The task's tools by name: Python tools (``python_tools``), and its MCP servers' tools
    as this process last listed them (``<server>.*`` expanded; see shared.mcp.catalog).
    Listing a server may start it, which takes seconds: inside a transaction, ``mcp=False``
    leaves them out, and the caller adds them once it has committed (see
    ``with_mcp_tools``)."""
    tools = python_tools(task, session)
    if mcp and any(is_mcp_name(name) for name in task.tools):
        from shared.mcp import catalog  # the MCP SDK loads only where a task names a server

        tools |= catalog.resolve(task.tools, agent=task.agent, tenant_id=task.tenant_id)
    return tools


def with_mcp_tools(ctx: Context) -> Context:
    """``ctx`` with its task's MCP tools too: read once the lease's transaction (which holds
    a database connection) has committed and its heartbeat runs, since it may wait for a
    server to start."""
    task = ctx.task
    if not any(is_mcp_name(name) for name in task.tools):
        return ctx
    # A server to start or list: wait as for a tool, without the step's turn.
    from shared.mcp import catalog

    waiting = catalog.may_wait(task.tools, agent=task.agent, tenant_id=task.tenant_id)
    with step_pool.waiting() if waiting else nullcontext():
        ctx.tools = task_tools(task)
    return ctx


_tenant_names: dict[str, str] = {}


def tenant_name(tenant_id: str, session: Session | None = None) -> str:
    """Tenant names never change, so each process looks each one up once: in ``session``,
    if the caller holds one (a second connection while holding one could wait forever on a
    pool that every step thread drained the same way), else in a session of its own."""
    name = _tenant_names.get(tenant_id)
    if name is None:
        with nullcontext(session) if session is not None else write_session() as reader:
            found = reader.scalar(select(Tenant.name).where(Tenant.id == tenant_id))
        name = _tenant_names[tenant_id] = found or tenant_id
    return name


def open_conversation(
    task: TaskState, agent: Agent, *, earlier: Sequence[Message] = ()
) -> list[Message]:
    """The chat before any step: the system prompt, the thread's history if the task is a
    thread's turn (``earlier``: :func:`earlier_turns`), and the task's input."""
    system = "\n\n".join(p for p in (agent.system_prompt, task.instructions) if p)
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    messages.extend(earlier)
    messages.extend(input_messages(task.input))
    return messages


def input_messages(given: Any) -> list[Message]:
    """A task's input as chat messages."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    return [{"role": m["role"], "content": m["content"]} for m in given]


def opening_length(task: TaskState, agent: Agent) -> int:
    """How many of the conversation's first messages the context policy never leaves out
    (``window.split``): the system prompt and the input; for a thread's later turn, the system
    prompt and the thread's first message, the rest being turns that may go, oldest first."""
    system = 1 if agent.system_prompt or task.instructions else 0
    if reads_earlier_turns(task):
        return system + 1
    return system + len(input_messages(task.input))


def reads_earlier_turns(task: TaskState) -> bool:
    """A thread's turn after its first: its conversation opens with its thread's history."""
    return task.thread_id is not None and task.turn is not None and task.turn > 1


def earlier_turns(session: Session, task: TaskState) -> list[Message]:
    """A thread's turn reads its thread's history: each earlier turn still in it, in order —
    its input, then its completed steps as the model reads them back — from their committed
    rows. Read with each fresh lease only: a following step carries it in memory.

    A turn that has ended is read once a process (:data:`_ENDED_TURNS`): its rows change only
    if it is retried, which gives it another attempt and more steps, and so another key. So
    the next turn of a long thread reads its turns' list and the steps of the turns this
    process has not read yet, not the whole thread again."""
    if not reads_earlier_turns(task):
        return []
    assert task.thread_id is not None
    rows = threads.turn_rows(session, task.thread_id, before=task.turn)
    keys = {row.id: (row.id, row.attempt, row.steps) for row in rows}
    missing = [row.id for row in rows if keys[row.id] not in _ENDED_TURNS]
    read = threads.turn_steps(session, missing)
    messages: list[Message] = []
    for row in rows:
        said = _ENDED_TURNS.get(keys[row.id])
        if said is None:
            said = input_messages(row.input) + step_messages(*read[row.id])
            if row.status in TERMINAL_STATUSES:
                _ENDED_TURNS.put(keys[row.id], said)
        messages.extend(dict(message) for message in said)  # the caller's own to change
    return messages


class _TurnMessages:
    """Ended turns' messages by (task, attempt, steps), the least recently used dropped past
    ``size`` (some megabytes of conversation at most)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._found: collections.OrderedDict[tuple[str, int, int], list[Message]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def __contains__(self, key: tuple[str, int, int]) -> bool:
        with self._lock:
            return key in self._found

    def get(self, key: tuple[str, int, int]) -> list[Message] | None:
        with self._lock:
            found = self._found.get(key)
            if found is not None:
                self._found.move_to_end(key)
            return found

    def put(self, key: tuple[str, int, int], messages: list[Message]) -> None:
        with self._lock:
            self._found[key] = messages
            while len(self._found) > self._size:
                self._found.popitem(last=False)


_ENDED_TURNS = _TurnMessages(size=2_000)


def latest_summary(session: Session, task: TaskState) -> Summary | None:
    """The summary that stands for the task's earlier steps (read only under ``summarize``)."""
    if policy_of(task.context, get_settings()).policy is not Policy.SUMMARIZE:
        return None
    return summaries.latest_summary(session, task.id)


def summary_messages(summary: Summary | None) -> list[Message]:
    """The message that stands for the steps ``summary`` covers (none without one)."""
    if summary is None:
        return []
    return [
        window.summary_message(
            number=summary.number, through_step=summary.through_step, content=summary.content
        )
    ]


def step_messages(
    steps: Sequence[Step], calls: Sequence[ToolCall], *, tools: Mapping[str, Tool] | None = None
) -> list[Message]:
    """Each step's response and its tool calls' outcomes, as the model reads them back (each
    result cut to its tool's limit, as ``tools``, the task's, define it)."""
    by_step: dict[int, list[ToolCall]] = defaultdict(list)
    for call in calls:
        by_step[call.step_number].append(call)
    messages: list[Message] = []
    for step in steps:
        said: Message = {
            "role": "assistant",
            "content": step.response.get("content"),
            "tool_calls": as_decided(step.response.get("tool_calls", []), by_step[step.number]),
        }
        if step.response.get("thinking"):  # sent back as it came (Anthropic's signed blocks)
            said["thinking"] = step.response["thinking"]
        messages.append(said)
        for call in by_step[step.number]:
            content = tool_runner.message_content(
                ok=call.status == CallStatus.SUCCEEDED,
                result=call.result,
                error=call.error,
                max_chars=tool_runner.result_limit(call.tool, tools),
            )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.provider_call_id,
                    "name": call.tool,
                    "content": content,
                }
            )
        messages.extend(output.feedback(step.response))
    return messages


def read_back(ctx: Context, response: ModelResponse) -> list[Message]:
    """The completed step as the model reads it back: what ``step_messages`` rebuilds from its
    rows, made from what this step answered and recorded. (The same JSON; an object read back
    from PostgreSQL may list its keys in another order.)"""
    answer = response.to_dict()
    calls = as_decided(answer["tool_calls"], ctx.calls.values())
    said: Message = {"role": "assistant", "content": answer["content"], "tool_calls": calls}
    if answer.get("thinking"):
        said["thinking"] = answer["thinking"]
    messages: list[Message] = [said]
    for position, call in enumerate(response.tool_calls):
        call_id = ledger.call_id(ctx.lease.step, position)
        outcome = ctx.outcomes.get(call_id)
        if outcome is None:  # settled before this lease: as its row says
            row = ctx.calls[call_id]
            outcome = tool_runner.Outcome(
                ok=row.status == CallStatus.SUCCEEDED, result=row.result, error=row.error
            )
        content = tool_runner.message_content(
            ok=outcome.ok,
            result=outcome.result,
            error=outcome.error,
            max_chars=tool_runner.result_limit(call.name, ctx.tools),
        )
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}
        )
    return messages + output.feedback(answer)


def as_decided(requested: list[dict[str, Any]], rows: Iterable[ToolCall]) -> list[dict[str, Any]]:
    """The model's tool calls as a person decided them: an edited call carries the arguments
    it ran with, so the model sees the call as edited."""
    edited = {r.provider_call_id: r.arguments for r in rows if r.original_arguments is not None}
    if not edited:
        return requested
    return [c | {"arguments": edited[c["id"]]} if c.get("id") in edited else c for c in requested]
