"""A tool process: ``python -m workers.tool_processes.serve --memory-mb N``.

It imports the registry (the built-in tools and ``RATCHET_AGENT_MODULES``) once, says it is
ready, then runs one call at a time as its worker sends them, and answers each with the
call's outcome, as data. What it inherits and what it keeps to itself:

- its requests and replies travel on pipes moved off its stdin and stdout: a tool that prints
  writes to stderr (the worker's log), and a subprocess of a tool inherits neither pipe;
- its address space is limited (``RLIMIT_AS``) for its whole life, and each call may use
  ``cpu_seconds`` more of CPU (``RLIMIT_CPU``: past it the kernel ends the process);
- it adopts the orphans of the processes its tools start (a child subreaper), so that its
  worker sees them as its descendants, and kills its whole process group when its worker
  goes away (the end of its request pipe), calls in flight and subprocesses included.

A ``MemoryError`` of a tool leaves the process in a state nobody should trust: its call's
outcome is unknown, and the process asks to be replaced. A fork of the tool that returns to
this loop (the tool called ``os.fork()`` and the child went on) exits at once, without a word
on the pipe it shares with its parent.
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import signal
import sys
import threading
from typing import Any

from shared.agents.registry import Registry, ToolContext, get_registry
from workers import tool_runner
from workers.tool_processes import frames, groups

PAGE = os.sysconf("SC_PAGE_SIZE")


class OutOfMemory(BaseException):
    """A tool's MemoryError, carried past the handlers that turn exceptions into outcomes."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.tool_processes.serve")
    parser.add_argument("--memory-mb", type=int, required=True)
    args = parser.parse_args(argv)
    requests, replies = _own_pipes()
    _watch_worker(requests)
    groups.adopt_orphans()
    registry = get_registry()
    _limit(resource.RLIMIT_AS, args.memory_mb * 1024 * 1024)
    _limit(resource.RLIMIT_CORE, 0)  # a crash leaves no core file of a tool's memory behind
    frames.send(replies, {"ready": os.getpid()})
    serve(registry, requests, replies)


def serve(registry: Registry, requests: int, replies: int) -> None:
    """Answer requests until the worker closes the pipe."""
    me = os.getpid()
    while (request := frames.receive(requests)) is not None:
        retire = False
        try:
            outcome = run(registry, request)
        except OutOfMemory:
            outcome = tool_runner.Outcome(
                ok=False,
                error=f"{request['tool']} ran out of memory (MemoryError)",
                unknown=True,
                stopped=True,  # this process ends after its reply
            )
            retire = True
        finally:
            if os.getpid() != me:  # a fork of the tool came back here: it has no say
                os._exit(0)
        reply = {"outcome": outcome.to_wire(), "rss": _rss(), "retire": retire}
        frames.send(replies, reply)
        if retire:
            return


def run(registry: Registry, request: dict[str, Any]) -> tool_runner.Outcome:
    """One call: its tool by name, with the CPU it may use from now on."""
    name = request["tool"]
    tool = registry.tools.get(name)
    if tool is None or tool.agent is not None:
        return tool_runner.Outcome(
            ok=False,
            error=f"{name} is not a Python tool of the modules this tool process imports "
            "(the built-in tools and RATCHET_AGENT_MODULES)",
        )
    context = ToolContext(**request["context"])
    used = resource.getrusage(resource.RUSAGE_SELF)
    _limit(resource.RLIMIT_CPU, int(used.ru_utime + used.ru_stime) + 1 + request["cpu_seconds"])
    try:
        result = tool.invoke(request["arguments"], context)
        return tool_runner.succeeded(name, result)  # a result too large to copy: MemoryError
    except MemoryError as exc:
        raise OutOfMemory from exc
    except Exception as exc:
        return tool_runner.failed(name, exc)


def _own_pipes() -> tuple[int, int]:
    """The request and reply pipes, moved to descriptors of their own (not inherited by
    subprocesses); stdin reads nothing and stdout writes to stderr from now on."""
    requests, replies = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    return requests, replies


def _watch_worker(requests: int) -> None:
    """Kill this process group when the worker's end of the request pipe closes (the worker
    exited or died): a call in flight has nobody to answer, and no tool outlives its worker."""

    def watch() -> None:
        hangup = select.poll()
        hangup.register(requests, 0)  # no events asked for: only the hang-up is reported
        while not hangup.poll():
            pass
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="tool-process-worker-watch", daemon=True).start()


def _limit(which: int, soft: int) -> None:
    """Set the soft limit ``which`` to ``soft`` (not past the hard limit, which stays)."""
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(which, (soft, hard))


def _rss() -> int:
    """This process's resident memory, in bytes."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * PAGE
    except OSError:  # not Linux: the peak, which only grows
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


if __name__ == "__main__":
    main()
