"""One run of model-written Python: started by a launcher, held to its limits, torn down.

Two launchers, chosen once per process (``shared.sandbox.host``):

- :class:`Bubblewrap` (the default) runs the code under Debian's ``bwrap`` in new user, pid,
  network, IPC and UTS namespaces: a read-only view of ``/usr`` (and the few ``/etc`` files the
  dynamic linker and Python read), a fresh ``/proc`` and ``/dev``, a small private ``/tmp``
  and ``/dev/shm``, the task's workspace as ``/workspace`` and nothing else of the host, all
  but those three read-only; no network device but loopback; an environment of ``PATH``,
  ``HOME`` and ``LANG`` alone.
- :class:`UnsafeSubprocess` (an operator's explicit choice) runs it as a plain child process
  in the workspace, with the same limits but none of the isolation.

Either way the code is read from a memory file on stdin by the system's ``python3 -I``, after a
few lines set its resource limits (CPU seconds, address space, processes, file size, no core
files) and the lowest priority; the run's wall time and the bytes read of its stdout and
stderr are bounded here. When the run ends, however it ends, its process tree is killed:
under bubblewrap the code is the init of its pid namespace, killed first, and the kernel kills
every process left in the namespace with it; then the launcher's process group (bwrap, or the
unsafe subprocess and what it forked) is killed too.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shared.sandbox import workspaces
from shared.settings import Settings

# The sandbox's PATH: the system's Python, wherever the distribution or image put it.
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
WORKSPACE = "/workspace"
READ_CHUNK = 65_536
# How often a run looks at its task's cancellation while the code prints nothing.
CANCEL_POLL_SECONDS = 0.2
# How long bwrap may take to exit once the code's pid namespace was killed.
TEARDOWN_SECONDS = 5.0
# What of /etc the dynamic linker and Python read; the rest (passwd, shadow, hosts, the
# worker's configuration) is not there.
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives")
# Top-level directories that are links into /usr on a merged-/usr system, or directories of
# their own on an older one.
SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")

# Runs first, inside: the limits the kernel holds the code to, then the code itself (stdin).
# A soft CPU limit a second below the hard one lets SIGXCPU end the run before SIGKILL must;
# the lowest priority leaves the worker's own threads the CPU when a run spins.
BOOTSTRAP = """\
import os, resource, sys
cpu, memory, processes, file_size = map(int, sys.argv[1:5])
os.setpriority(os.PRIO_PROCESS, 0, 19)
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.execv(sys.executable, [sys.executable, "-I", "-"])
"""


@dataclass(frozen=True)
class Limits:
    wall_seconds: float
    cpu_seconds: int
    memory_bytes: int
    processes: int
    output_bytes: int  # of stdout, and again of stderr
    file_bytes: int

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(
            wall_seconds=settings.sandbox_timeout_seconds,
            cpu_seconds=settings.sandbox_cpu_seconds,
            memory_bytes=settings.sandbox_memory_mb << 20,
            processes=settings.sandbox_max_processes,
            output_bytes=settings.sandbox_max_output_bytes,
            file_bytes=settings.sandbox_max_file_mb << 20,
        )

    def bootstrap_args(self) -> list[str]:
        return [
            "-I",
            "-c",
            BOOTSTRAP,
            str(self.cpu_seconds),
            str(self.memory_bytes),
            str(self.processes),
            str(self.file_bytes),
        ]


@dataclass(frozen=True)
class Result:
    """What the model reads of a run. ``exit_code`` is the code's, or negative for the signal
    that ended it; ``truncated``: stdout or stderr passed its limit and the run was stopped."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    files: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "timed_out": self.timed_out,
            "truncated": self.truncated,
            "files": self.files,
        }


@dataclass(frozen=True)
class Started:
    """A run's process tree: its leader, which leads a new process group, and (bubblewrap)
    the pipe on which bwrap says which process is the init of the code's pid namespace."""

    process: subprocess.Popen[bytes]
    namespace_info: int | None = None


class Launcher(Protocol):
    """Starts the code's process tree for one run."""

    @property
    def name(self) -> str: ...

    def start(self, workspace: Path, *, limits: Limits, code: int) -> Started: ...


def _as_user(uid: int | None) -> dict[str, Any]:
    """Popen's arguments that start a process as ``uid`` (its own group, no others)."""
    if uid is None:
        return {}
    return {"user": uid, "group": uid, "extra_groups": []}


@dataclass(frozen=True)
class Bubblewrap:
    """Runs the code in new namespaces under ``bwrap`` (see the module's docstring)."""

    bwrap: str
    uid: int | None = None
    name: str = "bubblewrap"

    def start(self, workspace: Path, *, limits: Limits, code: int) -> Started:
        info, info_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        arguments = ["--info-fd", str(info_w), *self.arguments(workspace, limits)]
        try:
            process = subprocess.Popen(
                [self.bwrap, *arguments, "python3", *limits.bootstrap_args()],
                stdin=code,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(info_w,),
                env={"PATH": SANDBOX_PATH},  # nothing of the worker's, even for bwrap
                cwd="/",
                start_new_session=True,
                umask=0o077,
                **_as_user(self.uid),
            )
        except BaseException:
            os.close(info)
            raise
        finally:
            os.close(info_w)
        return Started(process, namespace_info=info)

    def arguments(self, workspace: Path, limits: Limits) -> list[str]:
        namespaces = ["--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc"]
        namespaces += ["--unshare-uts", "--unshare-cgroup-try", "--disable-userns"]
        # The code is the namespace's init: bwrap's own child, which bwrap reaps, so nothing
        # is orphaned to the host's init; when it exits the kernel kills the rest.
        process = ["--as-pid-1", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
        environment = ["--clearenv", "--setenv", "PATH", SANDBOX_PATH, "--setenv", "HOME", "/tmp"]
        environment += ["--setenv", "LANG", "C.UTF-8"]
        system = ["--ro-bind", "/usr", "/usr", *self._system_dirs(), *self._etc()]
        private = ["--proc", "/proc", "--dev", "/dev"]
        for scratch in ("/tmp", "/dev/shm"):  # each no bigger than one file may be
            private += ["--size", str(limits.file_bytes), "--tmpfs", scratch]
        private += ["--bind", str(workspace), WORKSPACE, "--chdir", WORKSPACE]
        # bwrap builds the root and /dev in memory: read-only, nothing can fill them.
        sealed = ["--remount-ro", "/dev", "--remount-ro", "/"]
        return [*namespaces, *process, *environment, *system, *private, *sealed]

    @staticmethod
    def _system_dirs() -> list[str]:
        found: list[str] = []
        for name in SYSTEM_DIRS:
            path = Path("/", name)
            if path.is_symlink():
                found += ["--symlink", os.readlink(path), str(path)]
            elif path.is_dir():
                found += ["--ro-bind", str(path), str(path)]
        return found

    @staticmethod
    def _etc() -> list[str]:
        found = ["--dir", "/etc"]
        for name in ETC_FILES:
            found += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        return found


@dataclass(frozen=True)
class UnsafeSubprocess:
    """Runs the code as a plain child process in its workspace, with the limits but without
    namespaces: it sees the host's files and network as its uid may. An operator's opt-in."""

    python: str
    uid: int | None = None
    name: str = "unsafe-subprocess"

    def start(self, workspace: Path, *, limits: Limits, code: int) -> Started:
        process = subprocess.Popen(
            [self.python, *limits.bootstrap_args()],
            stdin=code,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": SANDBOX_PATH, "HOME": str(workspace), "LANG": "C.UTF-8"},
            cwd=workspace,
            start_new_session=True,
            umask=0o077,
            **_as_user(self.uid),
        )
        return Started(process)


def run(
    launcher: Launcher,
    source: str,
    *,
    workspace: Path,
    limits: Limits,
    cancelled: threading.Event | None = None,
) -> Result:
    """Run ``source`` in ``workspace`` and return what it printed, how it ended and the files
    it left there. Every process the run started is gone when this returns."""
    code = _memory_file(source)
    try:
        started = launcher.start(workspace, limits=limits, code=code)
    finally:
        os.close(code)
    process = started.process
    try:
        out, err, timed_out, truncated = _supervise(process, limits, cancelled or threading.Event())
    finally:
        _tear_down(started)
    return Result(
        exit_code=process.wait(),
        stdout=_text(out),
        stderr=_text(err),
        timed_out=timed_out,
        truncated=truncated,
        files=workspaces.listing(workspace),
    )


def _memory_file(source: str) -> int:
    """The code as a file descriptor the child reads from: no write can block on a pipe,
    and nothing of it is left on a disk."""
    fd = os.memfd_create("run_python", os.MFD_CLOEXEC)
    os.write(fd, source.encode("utf-8", "surrogatepass"))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _supervise(
    process: subprocess.Popen[bytes], limits: Limits, cancelled: threading.Event
) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout and stderr until both close, the wall time is up, one passes its limit or
    the task is cancelled; then wait for the exit within what is left of the wall time.
    Returns (stdout, stderr, timed out, truncated). The process is never reaped here, so its
    process group cannot be another's when it is killed."""
    assert process.stdout is not None
    assert process.stderr is not None
    deadline = time.monotonic() + limits.wall_seconds
    out, err = process.stdout.fileno(), process.stderr.fileno()
    kept = {out: bytearray(), err: bytearray()}
    timed_out = truncated = False
    with selectors.DefaultSelector() as selector:
        for fd in kept:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and not (timed_out or truncated or cancelled.is_set()):
            left = deadline - time.monotonic()
            timed_out = left <= 0
            for key, _ in selector.select(min(max(left, 0.0), CANCEL_POLL_SECONDS)):
                chunk = os.read(key.fd, READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fd)
                room = limits.output_bytes - len(kept[key.fd])
                kept[key.fd] += chunk[:room]
                truncated = truncated or len(chunk) > room
    if not (timed_out or truncated or cancelled.is_set()):
        timed_out = not _exits_within(process, deadline - time.monotonic())
    return bytes(kept[out]), bytes(kept[err]), timed_out, truncated


def _exits_within(process: subprocess.Popen[bytes], seconds: float) -> bool:
    """Whether the process exits within ``seconds`` (its stdout and stderr may close first),
    without reaping it."""
    pidfd = os.pidfd_open(process.pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], max(seconds, 0.0))
    finally:
        os.close(pidfd)
    return bool(ready)


def _tear_down(started: Started) -> None:
    """Kill the init of the code's pid namespace (the kernel then kills every process in it,
    and bwrap, which reaps it, exits), then SIGKILL the run's process group (bwrap, or the
    code and whatever it forked without bwrap). Nothing of the run outlives it."""
    process = started.process
    init = _namespace_init(started) if _running(process) else None
    if init is not None:
        try:
            signal.pidfd_send_signal(init, signal.SIGKILL)
            process.wait(timeout=TEARDOWN_SECONDS)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass  # gone already; or bwrap is stuck, and the group's SIGKILL below ends it
        finally:
            os.close(init)
    with contextlib.suppress(ProcessLookupError):  # the group has exited (not reaped yet)
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()
    if started.namespace_info is not None:
        os.close(started.namespace_info)


def _running(process: subprocess.Popen[bytes]) -> bool:
    """Whether the process has not exited, without reaping it."""
    return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None


def _namespace_init(started: Started) -> int | None:
    """A pidfd of the code's pid namespace init, as bwrap told it (None: it did not get so
    far, or the init is gone already)."""
    if started.namespace_info is None:
        return None
    try:
        said = json.loads(os.read(started.namespace_info, READ_CHUNK) or b"{}")
        return os.pidfd_open(int(said["child-pid"]))
    except (BlockingIOError, ValueError, KeyError, TypeError, ProcessLookupError):
        return None


def _text(data: bytes) -> str:
    """Output as text the ledger can hold: UTF-8 (a bad byte becomes U+FFFD) without NULs."""
    return data.decode("utf-8", "replace").replace("\x00", "\\x00")
