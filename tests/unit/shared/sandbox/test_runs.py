"""The sandbox's bwrap command line: what of the host it mounts, and the namespaces and
process rules it asks for. (What the code then meets is tests/integration/test_sandbox.py.)"""

from __future__ import annotations

from pathlib import Path

from shared.sandbox.runs import SANDBOX_PATH, Bubblewrap, Limits
from shared.settings import Settings

LIMITS = Limits(
    wall_seconds=5,
    cpu_seconds=5,
    memory_bytes=1 << 28,
    processes=8,
    output_bytes=1000,
    file_bytes=1 << 20,
)
SYSTEM = {"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"}


def options(arguments: list[str], name: str, arity: int) -> list[list[str]]:
    return [arguments[i + 1 : i + 1 + arity] for i, a in enumerate(arguments) if a == name]


def test_only_the_system_and_the_workspace_of_the_host_are_mounted() -> None:
    arguments = Bubblewrap("bwrap").arguments(Path("/srv/sandbox/task-1"), LIMITS)

    read_only = {source for source, _ in options(arguments, "--ro-bind", 2)}
    maybe = {source for source, _ in options(arguments, "--ro-bind-try", 2)}
    assert read_only <= SYSTEM
    assert all(
        source.startswith("/etc/ld.so") or source in ("/etc/localtime", "/etc/alternatives")
        for source in maybe
    )
    assert options(arguments, "--bind", 2) == [["/srv/sandbox/task-1", "/workspace"]]
    assert options(arguments, "--remount-ro", 1) == [["/dev"], ["/"]]
    assert options(arguments, "--tmpfs", 1) == [["/tmp"], ["/dev/shm"]]
    assert options(arguments, "--size", 1) == [[str(1 << 20)], [str(1 << 20)]]


def test_the_code_gets_namespaces_of_its_own_and_no_environment() -> None:
    arguments = Bubblewrap("bwrap").arguments(Path("/w"), LIMITS)

    for namespace in ("user", "pid", "net", "ipc", "uts"):
        assert f"--unshare-{namespace}" in arguments
    assert {"--disable-userns", "--as-pid-1", "--die-with-parent", "--new-session"} <= set(
        arguments
    )
    assert "--clearenv" in arguments
    assert options(arguments, "--setenv", 2) == [
        ["PATH", SANDBOX_PATH],
        ["HOME", "/tmp"],
        ["LANG", "C.UTF-8"],
    ]


def test_limits_come_from_the_settings() -> None:
    settings = Settings(sandbox_memory_mb=256, sandbox_max_file_mb=2, sandbox_max_processes=9)

    limits = Limits.from_settings(settings)

    assert (limits.memory_bytes, limits.file_bytes, limits.processes) == (256 << 20, 2 << 20, 9)
    assert limits.bootstrap_args()[3:] == [
        str(settings.sandbox_cpu_seconds),
        str(256 << 20),
        "9",
        str(2 << 20),
    ]
