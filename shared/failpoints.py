"""Named points in the step where tests inject faults, set by ``RATCHET_FAILPOINTS``.

``RATCHET_FAILPOINTS="after_model_commit=kill_once:/tmp/marker,after_tool=sleep:2"``

Actions: ``kill`` (SIGKILL this process), ``kill_once:<path>`` (SIGKILL, only for the first
process to create ``<path>``), ``sleep:<seconds>``, ``raise``. Unset, a failpoint costs one
dictionary lookup. This is how the crash tests kill a worker at an exact commit boundary.
"""

from __future__ import annotations

import os
import signal
import time
from functools import lru_cache

POINTS = (
    "model_call",
    "after_summary_commit",  # a summary of earlier turns is committed, the step's call not made
    "after_model_commit",
    "tool_call",
    "after_tool",
    "after_call_commit",  # one of a step's calls that run at once committed its outcome
    "after_step_commit",
    "before_webhooks",  # a commit's webhooks are committed, not yet handed to the sender
    "after_child_start",  # a sub-agent call's child committed, the call not yet parked
    "after_park",  # the task parked on its waits, the ones already settled not yet looked at
    "after_child_end",  # a child's end committed, its parent's wait not yet settled
    "resume_parked",  # a step resumed a parked call, its outcome not yet committed
)


class InjectedFault(Exception):
    """A failpoint set to ``raise`` was hit."""


@lru_cache
def _parse(spec: str) -> dict[str, str]:
    actions = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, action = item.partition("=")
        if name not in POINTS:
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(POINTS)}")
        actions[name] = action
    return actions


def _claim(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def hit(name: str) -> None:
    action = _parse(os.environ.get("RATCHET_FAILPOINTS", "")).get(name)
    if not action:
        return
    kind, _, arg = action.partition(":")
    if kind == "kill" or (kind == "kill_once" and _claim(arg)):
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "sleep":
        time.sleep(float(arg))
    elif kind == "raise":
        raise InjectedFault(f"failpoint {name}")
