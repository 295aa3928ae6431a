"""Tools and agents for the tests, loaded through RATCHET_AGENT_MODULES like any extension."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ratchet import Agent, ToolContext, register_agent, tool


def _journal() -> str | None:
    return os.environ.get("RATCHET_TEST_JOURNAL")


def _record(kind: str, context: ToolContext, journal: str | None = None) -> None:
    # Side effects land in a file so a test (or another process) can count them. A slow tool
    # names the file it was called with: abandoned past its limit, it may write after its
    # test has ended, and must not write into the next test's journal.
    journal = journal or _journal()
    if journal:
        with Path(journal).open("a") as handle:
            handle.write(f"{kind} {context.idempotency_key}\n")


@tool
def send_email(to: str, subject: str, context: ToolContext) -> str:
    """Send an email (not idempotent: after a crash mid-call the task fails)."""
    _record("email", context)
    return f"sent {subject!r} to {to}"


@tool(on_unknown_outcome="tell_model")
def charge_card(amount_cents: int, context: ToolContext) -> str:
    """Charge a card (not idempotent: after a crash mid-call the model is told)."""
    _record("charge", context)
    return f"charged {amount_cents}"


@tool(timeout=0.2)
def slow_send(seconds: float, context: ToolContext) -> str:
    """Send something slowly (not idempotent, with a 0.2 s limit)."""
    journal = _journal()
    time.sleep(seconds)
    _record("slow", context, journal)
    return "sent"


@tool(idempotent=True)
def upsert_record(key: str, context: ToolContext) -> str:
    """Write a record by key (idempotent: safe to run again)."""
    _record("upsert", context)
    return f"stored {key}"


@tool(requires_approval=True)
def wire_money(to: str, amount: int, context: ToolContext) -> str:
    """Wire money (always asks a person first)."""
    _record("wire", context)
    return f"wired {amount} to {to}"


@tool(on_unknown_outcome="ask")
def ship_order(order: str, context: ToolContext) -> str:
    """Ship an order (not idempotent: after a crash mid-call a person decides whether to
    ship it again)."""
    _record("ship", context)
    return f"shipped {order}"


@tool(timeout=0.2, on_unknown_outcome="ask")
def slow_ship(seconds: float, context: ToolContext) -> str:
    """Ship slowly (a 0.2 s limit; when it is abandoned a person decides about a rerun)."""
    journal = _journal()
    time.sleep(seconds)
    _record("slow_ship", context, journal)
    return "shipped"


@tool(requires_approval=lambda args: args.get("amount", 0) > 500)
def refund(amount: int, context: ToolContext) -> str:
    """Refund a customer (asks a person above 500)."""
    _record("refund", context)
    return f"refunded {amount}"


register_agent(
    Agent(
        name="ops",
        description="Test agent with side-effecting tools.",
        system_prompt="You run operations.",
        tools=(
            "send_email",
            "charge_card",
            "slow_send",
            "upsert_record",
            "calculator",
            "sleep",
            "http_request",
            "wire_money",
            "refund",
            "ship_order",
            "slow_ship",
        ),
    )
)


# A reader whose conversation outgrows a small context window: each page is a long result.
PAGE_WORDS = 60


@tool(idempotent=True)
def read_page(number: int) -> str:
    """Read page ``number`` of the test book."""
    return " ".join(f"page{number}-word{i}" for i in range(PAGE_WORDS))


@tool(idempotent=True, max_result_chars=2_000)
def read_archive(megabytes: int = 1) -> str:
    """Read the whole test archive (large)."""
    return "archive " * (megabytes * 131_072)


register_agent(
    Agent(
        name="reader",
        description="Test agent whose conversation outgrows a small context window.",
        system_prompt="You read the test book one page at a time.",
        tools=("read_page", "read_archive"),
    )
)


# An agent whose model calls never stream (a task's own ``stream`` still wins).
register_agent(
    Agent(
        name="quiet",
        description="Test agent that asks for whole answers.",
        system_prompt="You answer in one piece.",
        tools=("calculator",),
        stream=False,
    )
)


# Composition: a researcher sub-agent (two calculator steps, then its answer), an agent that
# hands work to it, a sub-agent that is slow, and a tool that parks its task on the outside
# world (a durable wait).
_RESEARCH_SCRIPT = [
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]},
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "2**10"}}]},
    {"content": "researched: 42 and 1024", "usage": {"input_tokens": 100, "output_tokens": 10}},
]

register_agent(
    Agent(
        name="researcher",
        description="Researches one question and reports what it found.",
        system_prompt="You research the question you are given.",
        model="scripted",
        model_options={"script": _RESEARCH_SCRIPT},
        tools=("calculator",),
    )
)

# Long enough to be caught running; a test that waits for it to end takes this long.
SLOW_RESEARCH_MS = int(os.environ.get("RATCHET_TEST_SLOW_RESEARCH_MS", "1500"))

register_agent(
    Agent(
        name="slow_researcher",
        description="Researches slowly.",
        system_prompt="You take your time.",
        model="scripted",
        model_options={"script": [{"content": "slowly researched", "delay_ms": SLOW_RESEARCH_MS}]},
        tools=(),
    )
)


@tool
def await_ci(run: str, context: ToolContext) -> str:
    """Start a CI run and wait for its result (a durable wait)."""
    from ratchet import Wait

    _record("ci", context)
    raise Wait(
        {"run": run},
        timeout_seconds=float(os.environ.get("RATCHET_TEST_WAIT_S", "600")),
        on_timeout=os.environ.get("RATCHET_TEST_WAIT_POLICY", "fail_call"),
    )  # type: ignore[arg-type]


# A sub-agent whose one model call takes half a second: slow next to a parent's turn.
register_agent(
    Agent(
        name="napper",
        description="Answers after a pause.",
        system_prompt="You take a moment.",
        model="scripted",
        model_options={"script": [{"content": "rested", "delay_ms": 500}]},
        tools=(),
    )
)


# A middle manager: hands two slow researches on (so a lead's tree has grandchildren).
register_agent(
    Agent(
        name="manager",
        description="Splits the work between two slow researchers.",
        system_prompt="You split the work.",
        model="scripted",
        model_options={
            "script": [
                {
                    "tool_calls": [
                        {"name": "slow_researcher", "arguments": {"task": "half one"}},
                        {"name": "slow_researcher", "arguments": {"task": "half two"}},
                    ]
                },
                {"content": "both halves researched"},
            ]
        },
        tools=("slow_researcher",),
    )
)
# Calls of one answer that run at once (workers.steps.fan_out). ``meet`` waits until
# ``parties`` calls of its group run together, so calls of a group that all return ok ran at
# once; each group keeps what it saw, for its test to read (steps run in the test's process).
MEET_LIMIT_SECONDS = 30.0


@dataclass
class Meeting:
    """One group of ``meet`` calls: ``seen`` lists ("start" | "end", call) in order."""

    parties: int
    barrier: threading.Barrier
    running: int = 0
    peak: int = 0
    seen: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


_meetings: dict[str, Meeting] = {}
_meetings_lock = threading.Lock()


def meeting(group: str, parties: int = 0) -> Meeting:
    """The calls of ``group`` so far (made on first use, with the calls' ``parties``)."""
    with _meetings_lock:
        if group not in _meetings:
            _meetings[group] = Meeting(parties, threading.Barrier(parties or 1))
        return _meetings[group]


@tool(idempotent=True)
def meet(group: str, parties: int, context: ToolContext, hold: float = 0.0) -> str:
    """Wait until ``parties`` calls of ``group`` run at once (at most 30 s), then ``hold``
    seconds more (in which a call that should not run yet, were it running, is counted)."""
    found = meeting(group, parties)
    with found.lock:
        found.running += 1
        found.peak = max(found.peak, found.running)
        found.seen.append(("start", context.call_id))
    try:
        found.barrier.wait(MEET_LIMIT_SECONDS)
        context.cancelled.wait(hold)
    finally:
        with found.lock:
            found.running -= 1
            found.seen.append(("end", context.call_id))
    return f"met in {group}"


@tool(idempotent=True)
def upsert_slowly(key: str, seconds: float, context: ToolContext) -> str:
    """Write a record by key, taking ``seconds`` (idempotent; each run is journaled as it
    starts, so a run cut short by a kill is counted too)."""
    journal = _journal()
    _record("upsert_slowly", context, journal)
    context.cancelled.wait(seconds)
    return f"stored {key}"


register_agent(
    Agent(
        name="lead",
        description="Hands research to sub-agents and waits on CI.",
        system_prompt="You delegate.",
        tools=(
            "researcher",
            "slow_researcher",
            "napper",
            "manager",
            "lead",
            "calculator",
            "await_ci",
            "ask_user",
        ),
    )
)


register_agent(
    Agent(
        name="crew",
        description="Test agent whose answers ask for several calls at once.",
        system_prompt="You do several things at once.",
        tools=(
            "meet",
            "upsert_record",
            "upsert_slowly",
            "sleep",
            "send_email",
            "slow_send",
            "slow_ship",
        ),
    )
)


# Tenant secrets: a tool that declares one, and reports (carelessly) what it was handed; a tool
# that declares none. Each logs the value it holds, as a careless tool would.
_secrets_log = logging.getLogger("tests.sample_agents.secrets")


@tool(idempotent=True, secrets=("DEPLOY_TOKEN",))
def use_token(context: ToolContext, fail: bool = False) -> dict[str, object]:
    """Deploy with the tenant's DEPLOY_TOKEN; returns what it was handed."""
    token = context.secrets.get("DEPLOY_TOKEN")
    _secrets_log.warning("deploying with token %s", token)
    if fail:
        raise RuntimeError(f"the deploy server refused token {token}")
    return {"names": sorted(context.secrets), "token": token, "echo": {str(token): [token]}}


@tool(idempotent=True)
def peek_secrets(context: ToolContext) -> dict[str, object]:
    """Report which tenant secrets this call was handed (it declares none)."""
    return {"names": sorted(context.secrets), "values": sorted(context.secrets.values())}


# Isolated tools (isolation="process"): each call runs in a tool process of the worker, killed
# at its limit. The hostile ones break their process in every way a tool can; the model is
# told their calls failed (tell_model), and the worker goes on.
LATE_HOOK_LIMIT_SECONDS = 1.0


def _post(url: str, context: ToolContext) -> None:
    import httpx

    httpx.post(url, json={"call": context.idempotency_key}, timeout=10).raise_for_status()


@tool(isolation="process", timeout=LATE_HOOK_LIMIT_SECONDS, on_unknown_outcome="tell_model")
def late_hook(url: str, seconds: float, context: ToolContext) -> str:
    """Call ``url`` after ``seconds`` (isolated, with a 1 s limit)."""
    time.sleep(seconds)
    _post(url, context)
    return "called"


@tool(isolation="thread", timeout=LATE_HOOK_LIMIT_SECONDS, on_unknown_outcome="tell_model")
def late_hook_in_thread(url: str, seconds: float, context: ToolContext) -> str:
    """Call ``url`` after ``seconds`` (on a thread, with a 1 s limit: abandoned, not killed)."""
    time.sleep(seconds)
    _post(url, context)
    return "called"


@tool(isolation="process", on_unknown_outcome="tell_model")
def hog_memory(gigabytes: int = 4) -> int:
    """Allocate ``gigabytes`` of memory."""
    return len(bytearray(gigabytes << 30))


@tool(isolation="process", on_unknown_outcome="tell_model")
def fork_bomb() -> str:
    """Fork for ever."""
    while True:
        os.fork()


@tool(isolation="process", on_unknown_outcome="tell_model")
def segfault() -> str:
    """Read the memory at address 0."""
    import ctypes

    return repr(ctypes.string_at(0))


@tool(isolation="process", on_unknown_outcome="tell_model")
def exit_abruptly(status: int = 3) -> str:
    """End the process at once, without unwinding."""
    os._exit(status)


@tool(isolation="process", on_unknown_outcome="tell_model")
def burn_cpu() -> str:
    """Spin for ever."""
    while True:
        pass


@tool(isolation="process", idempotent=True)
def whoami(context: ToolContext, echo: str = "") -> dict[str, object]:
    """Say which process runs the call, what it was told, and print to stdout meanwhile."""
    print("a tool that prints does not garble its reply")
    return {
        "pid": os.getpid(),
        "echo": echo,
        "secrets": dict(context.secrets),
        "key": context.idempotency_key,
    }


@tool(isolation="process", idempotent=True)
def spawn_sleeper(seconds: float = 60.0) -> int:
    """Start a subprocess that outlives the call."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"]).pid


@tool(isolation="process", idempotent=True)
def grow(megabytes: int) -> int:
    """Keep ``megabytes`` of memory for the rest of the process's life (a leak)."""
    _leak.append(bytearray(megabytes << 20))
    for block in _leak:
        block[::4096] = b"x" * len(block[::4096])  # resident, not just reserved
    return len(_leak)


_leak: list[bytearray] = []


@tool(isolation="process", idempotent=True)
def park_on_ci(run: str) -> str:
    """Start a CI run and wait for its result (a durable wait, from a tool process)."""
    from ratchet import Wait

    raise Wait({"run": run}, timeout_seconds=60)


register_agent(
    Agent(
        name="deployer",
        description="Test agent whose tools read tenant secrets.",
        system_prompt="You deploy.",
        tools=("use_token", "peek_secrets"),
    )
)


register_agent(
    Agent(
        name="isolated",
        description="Test agent whose tools run in tool processes.",
        system_prompt="You call isolated tools.",
        tools=(
            "late_hook",
            "late_hook_in_thread",
            "hog_memory",
            "fork_bomb",
            "segfault",
            "exit_abruptly",
            "burn_cpu",
            "whoami",
            "spawn_sleeper",
            "grow",
            "park_on_ci",
            "sleep",
            "calculator",
        ),
    )
)
