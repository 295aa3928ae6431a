"""What ships: the wheel and the image hold the product's packages and no benchmark; a dev
install runs the benchmarks as ``ratchet bench NAME``, and anywhere else that command says in
one line where they come from."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = {"api", "workers", "shared", "ratchet"}
BENCHMARKS = (
    "checkpoint",
    "limiter",
    "delivery",
    "capacity",
    "api",
    "history",
    "throughput",
    "dashboard",
    "fairness",
    "neighbours",
)
# The interpreter's environment, without a path that would put the checkout on it: a
# command run from elsewhere finds the checkout only as an installed `ratchet` does.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def wheel_packages() -> list[str]:
    """The packages the wheel holds, found as setuptools finds them for pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = config["tool"]["setuptools"]["packages"]["find"]
    return find_packages(str(ROOT), include=found["include"], exclude=found["exclude"])


def test_the_wheel_holds_the_product_and_no_benchmark() -> None:
    packages = wheel_packages()
    assert {name.split(".")[0] for name in packages} == PRODUCT
    assert [name for name in packages if "bench" in name] == []
    assert (ROOT / "benchmarks" / "__init__.py").is_file()  # a package, left out


def test_the_image_copies_no_benchmark() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
    sources = {
        source
        for line in dockerfile
        if line.startswith("COPY ") and "--from=" not in line
        for source in line.split()[1:-1]
    }
    assert "benchmarks" not in sources
    copied = [ROOT / source for source in sources if (ROOT / source).is_dir()]
    assert {path.name for path in copied} == PRODUCT
    modules = [path.relative_to(ROOT) for folder in copied for path in folder.rglob("*.py")]
    assert [str(path) for path in modules if "bench" in str(path)] == []


def ratchet(*args: str, cwd: Path, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """``ratchet ARGS`` as the installed command runs it (the working directory not on the
    path), after ``prelude``."""
    code = f"{prelude}import sys; from ratchet.cli import main; sys.argv[0] = 'ratchet'; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        env=CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_dev_install_lists_every_benchmark_from_any_directory(tmp_path: Path) -> None:
    done = ratchet("bench", "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Usage: ratchet bench" in done.stdout
    listed = {line.strip("│ ").split(" ")[0] for line in done.stdout.splitlines()}
    assert set(BENCHMARKS) <= listed


def test_the_noisy_neighbour_benchmark_is_a_bench_command(tmp_path: Path) -> None:
    done = ratchet("bench", "neighbours", "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: ratchet bench neighbours")
    assert "--patterns" in done.stdout


def test_the_other_commands_load_no_benchmark(tmp_path: Path) -> None:
    done = ratchet(
        "--help",
        cwd=tmp_path,
        prelude="import atexit, sys; atexit.register(lambda: print(*sorted("
        "m for m in sys.modules if 'bench' in m), file=sys.stderr)); ",
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ""


@pytest.mark.parametrize("args", [("bench",), ("bench", "--help"), ("bench", "checkpoint")])
def test_without_the_benchmarks_ratchet_bench_says_where_they_come_from(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    """As in an installed wheel or the image, where no ``benchmarks`` package exists."""
    done = ratchet(*args, cwd=tmp_path, prelude="import sys; sys.modules['benchmarks'] = None; ")
    assert done.returncode == 1
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert "the benchmarks come with a checkout's dev install (pip install -e '.[dev]')" in line


def test_the_python_client_loads_no_server_machinery() -> None:
    # An application that imports ratchet.Client gets an HTTP client, not the store's metrics
    # (prometheus_client read once at its load: a worker's metrics were lost when it came in
    # through the client before the worker set its metrics directory), nor Celery or Redis.
    probe = (
        "import sys, ratchet, ratchet.client; "
        "print(sorted(m for m in ('prometheus_client', 'celery', 'redis', 'psycopg') "
        "if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert done.stdout.strip() == "[]"


def test_the_api_and_the_workers_load_the_mcp_sdk_only_for_a_task_that_names_a_server() -> None:
    # Its import takes some 0.7 s, which every worker and API process would pay at start.
    probe = (
        "import sys, api.main, workers.app; "
        "print(sorted(m for m in ('mcp', 'mcp_types') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert done.stdout.strip() == "[]"
