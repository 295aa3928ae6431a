"""Each task's workspace: the one directory its sandboxed code may write, kept across the
task's steps and removed when the task ends.

A workspace is ``<sandbox dir>/<task id>`` on the worker host that ran the code; nothing else
of the host is visible to the code. The step that ends a task removes it
(``workers.steps.commits``), and every worker process's sweeper removes those of tasks that
ended anywhere else (``sweep``). When the worker runs as root the code runs as the sandbox's
own uid, which owns the workspace: the sandbox directory is then only traversable by others
(``0711``), and each workspace readable by that uid alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from shared.errors import ToolError
from shared.settings import Settings, get_settings

log = logging.getLogger("ratchet.sandbox")

# A task id names a directory: it must be a single path segment, and a probe's
# workspace (which starts with a dot) is never taken for a task's.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
# What a run's result lists of its workspace: a hostile run may create millions of files.
MAX_LISTED_FILES = 100
MAX_VISITED_ENTRIES = 10_000


def root(settings: Settings | None = None) -> Path:
    """The directory that holds every workspace of this host (``RATCHET_SANDBOX_DIR``)."""
    settings = settings or get_settings()
    return (settings.sandbox_dir or settings.data_dir / "sandbox").absolute()


def sandbox_uid(settings: Settings | None = None) -> int | None:
    """The uid code runs as: ``RATCHET_SANDBOX_UID`` when this process is root (the kernel's
    limit on processes never applies to root), else None (this process's own)."""
    if os.geteuid() != 0:
        return None
    return (settings or get_settings()).sandbox_uid


def path_of(task_id: str) -> Path:
    if not _NAME.fullmatch(task_id):
        raise ToolError(f"no workspace can be named after task id {task_id!r}")
    return root() / task_id


def open_workspace(task_id: str) -> Path:
    """The task's workspace, created empty the first time."""
    return create(path_of(task_id))


def create(path: Path) -> Path:
    """``path`` (in the sandbox directory) as a workspace: created if need be, owned by the
    uid the code runs as."""
    uid = sandbox_uid()
    top = path.parent
    top.mkdir(parents=True, exist_ok=True)
    top.chmod(0o711 if uid is not None else 0o700)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        return path
    if uid is not None:
        os.chown(path, uid, uid)
    return path


def remove(task_id: str) -> None:
    """Remove the task's workspace, if this host has one. Never raises: what is left over is
    the sweeper's to remove."""
    try:
        path = path_of(task_id)
    except ToolError:
        return
    remove_path(path)


def remove_path(path: Path) -> None:
    """Remove the workspace at ``path`` if there is one; never raises."""
    try:
        if not path.exists():
            return
        _make_removable(path)
        shutil.rmtree(path, ignore_errors=True)
        left = path.exists()
    except OSError:
        left = True
    if left:
        log.warning("workspace %s could not be removed in full; the sweeper tries again", path)


def _make_removable(path: Path) -> None:
    """Code may take the permissions off its own directories; the owner can give them back
    (root needs no such thing). Links are never followed."""
    if os.geteuid() == 0:
        return
    for directory, subdirectories, _ in os.walk(path):
        for name in (directory, *(os.path.join(directory, d) for d in subdirectories)):
            with contextlib.suppress(OSError):  # gone, or a link
                os.chmod(name, 0o700, follow_symlinks=False)


def present() -> list[str]:
    """The task ids that have a workspace on this host."""
    try:
        entries = list(os.scandir(root()))
    except FileNotFoundError:
        return []
    return [e.name for e in entries if _NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]


def sweep(ended: Callable[[Collection[str]], Collection[str]]) -> int:
    """Remove the workspaces of tasks that ended (``ended`` says which of the ids present
    did: terminal, or gone); returns how many. A backstop for the step that ends a task,
    which removes its own, and for tasks ended outside any step (a cancel, a wait's expiry)."""
    names = present()
    if not names:
        return 0
    gone = list(ended(names))
    for name in gone:
        remove(name)
    return len(gone)


def listing(path: Path) -> list[dict[str, Any]]:
    """The regular files under ``path``, by name relative to it, with their sizes in bytes:
    the first ``MAX_LISTED_FILES`` by name. Links are listed by no one and never followed."""
    found: list[dict[str, Any]] = []
    pending, visited = [path], 0
    while pending and visited < MAX_VISITED_ENTRIES:
        directory = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            visited += 1
            if entry.is_dir(follow_symlinks=False):
                pending.append(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                name = str(Path(entry.path).relative_to(path))
                found.append({"name": name, "size": entry.stat(follow_symlinks=False).st_size})
    found.sort(key=lambda f: str(f["name"]))
    return found[:MAX_LISTED_FILES]
