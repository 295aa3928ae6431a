"""Whether this host can run the sandbox, found out once per process and said in one line.

A worker checks at start (``workers.app``) by running a real, trivial program in a real
workspace with the settings' launcher: ``bwrap`` may be missing, too old, or denied the
namespaces it needs (a container's seccomp profile, a sysctl), and the sandbox directory may
be out of reach of the uid the code runs as. When it cannot, ``run_python`` is unavailable
and each of its calls fails with that same reason; nothing falls back to a weaker sandbox
unless the operator set ``RATCHET_SANDBOX=unsafe-subprocess``.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from dataclasses import dataclass, replace

from shared.sandbox import runs, workspaces
from shared.settings import Settings, get_settings

log = logging.getLogger("ratchet.sandbox")

GUIDE = "see the sandbox guide"
PROBE_WORKSPACE = ".probe"
PROBE_SECONDS = 30.0


@dataclass(frozen=True)
class Availability:
    """A launcher to run code with, or the reason there is none."""

    launcher: runs.Launcher | None
    reason: str = ""


_checked: dict[tuple[object, ...], Availability] = {}
_lock = threading.RLock()


def check(*, quiet: bool = False) -> Availability:
    """This process's sandbox for the current settings, checked the first time, and then
    logged unless ``quiet`` (a worker checks before its logging is set up, and before it
    forks, so its pool processes inherit the answer; it logs it with :func:`announce`)."""
    settings = get_settings()
    key = (
        settings.sandbox,
        settings.sandbox_bwrap,
        workspaces.root(settings),
        workspaces.sandbox_uid(settings),
    )
    with _lock:
        if key not in _checked:
            _checked[key] = _probe(settings)
            if not quiet:
                announce()
        return _checked[key]


def _probe(settings: Settings) -> Availability:
    if settings.sandbox == "off":
        return Availability(None, "run_python is off on this worker (RATCHET_SANDBOX=off)")
    uid = workspaces.sandbox_uid(settings)
    launcher: runs.Launcher
    if settings.sandbox == "unsafe-subprocess":
        python = shutil.which("python3", path=runs.SANDBOX_PATH)
        if python is None:
            return Availability(
                None, f"run_python is unavailable: no python3 in {runs.SANDBOX_PATH}"
            )
        launcher = runs.UnsafeSubprocess(python, uid)
    else:
        bwrap = shutil.which(settings.sandbox_bwrap)
        if bwrap is None:
            return Availability(
                None,
                f"run_python is unavailable: bubblewrap ({settings.sandbox_bwrap}) is not "
                f"installed on this host; install Debian's bubblewrap package ({GUIDE})",
            )
        launcher = runs.Bubblewrap(bwrap, uid)
    problem = _try(launcher, settings)
    if problem:
        return Availability(
            None, f"run_python is unavailable: the {launcher.name} sandbox {problem} ({GUIDE})"
        )
    return Availability(launcher)


def _try(launcher: runs.Launcher, settings: Settings) -> str:
    """Run a program that prints ``ok`` as the tool would; what went wrong, or ''."""
    limits = replace(runs.Limits.from_settings(settings), wall_seconds=PROBE_SECONDS)
    # A name of its own: worker processes on one host may probe at once.
    path = workspaces.root(settings) / f"{PROBE_WORKSPACE}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        workspace = workspaces.create(path)
        result = runs.run(launcher, "print('ok')", workspace=workspace, limits=limits)
    except OSError as exc:
        return f"cannot start: {exc}"
    finally:
        workspaces.remove_path(path)
    if result.stdout == "ok\n":
        return ""
    said = result.stderr.strip().splitlines()
    detail = said[-1] if said else f"exit code {result.exit_code}"
    uid = "" if workspaces.sandbox_uid(settings) is None else f" as uid {settings.sandbox_uid}"
    return f"does not start on this host{uid}: {detail}"


def announce() -> None:
    """Log the one line that says whether, and how, this process runs code."""
    availability = check(quiet=True)
    launcher = availability.launcher
    if launcher is None:
        log.warning("%s", availability.reason)
    elif launcher.name == "unsafe-subprocess":
        log.warning(
            "run_python runs code in a plain subprocess (RATCHET_SANDBOX=unsafe-subprocess): "
            "it is not isolated from this host's files and network (%s)",
            GUIDE,
        )
    else:
        log.info("run_python runs code in a %s sandbox", launcher.name)
