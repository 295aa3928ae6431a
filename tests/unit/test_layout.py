"""The layout's house rules: shared/ imports neither api/ nor workers/, api/ never imports
workers/; folders are nouns (each package says what lives in it). The size limits are guides
that catch real outliers, not walls: a module's size comes from its concept, and code is
never moved (nor a docstring shortened) to fit a number."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "shared": ("api", "workers", "ratchet"),
    "api": ("workers", "ratchet"),
    "workers": ("api", "ratchet"),
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_direction(package: str) -> None:
    offenders = []
    for path in (ROOT / package).rglob("*.py"):
        for module in imported_modules(path):
            if module.split(".")[0] in FORBIDDEN[package]:
                offenders.append(f"{path.relative_to(ROOT)} imports {module}")
    assert offenders == []


# The front doors — the HTTP routes, the dashboard's pages, the CLI — call the actions
# (shared/actions/) and never reach into one another.
FRONT_DOORS = {
    "api/dashboard": ("api.routes",),
    "api/routes": ("api.dashboard",),
    "ratchet": ("api.routes",),
}


@pytest.mark.parametrize("door", sorted(FRONT_DOORS))
def test_front_doors_do_not_import_one_another(door: str) -> None:
    offenders = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((ROOT / door).rglob("*.py"))
        for module in imported_modules(path)
        if module.startswith(FRONT_DOORS[door])
    ]
    assert offenders == []


# The benchmarks belong to a checkout's dev install, outside the wheel and the image: no
# product module imports them but ``ratchet bench``'s loader, when that command runs.
BENCHMARKS_LOADER = ("ratchet/cli.py", "load_benchmarks")


def imports_by_function(tree: ast.AST, function: str = "") -> list[tuple[str, str]]:
    """(the function an import is in, or "" at module level; the module it imports)."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import):
            found += [(function, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((function, node.module))
        inner = node.name if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else function
        found += imports_by_function(node, inner)
    return found


def test_only_the_bench_command_loads_the_benchmarks_and_only_when_it_runs() -> None:
    loaders = {
        (str(path.relative_to(ROOT)), function)
        for path in product_modules()
        for function, module in imports_by_function(ast.parse(path.read_text()))
        if module.split(".")[0] == "benchmarks"
    }
    assert loaders == {BENCHMARKS_LOADER}


PRODUCT = ("api", "workers", "shared", "ratchet")
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 60
MAX_MODULES_PER_FOLDER = 24


def product_modules() -> list[Path]:
    return [
        path
        for package in PRODUCT
        for path in sorted((ROOT / package).rglob("*.py"))
        if "migrations" not in path.parts
    ]


def test_no_module_is_an_outlier_in_length() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in product_modules()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_function_is_over_60_lines() -> None:
    long = {}
    for path in product_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = length
    assert long == {}


def packages() -> list[Path]:
    return sorted(
        init.parent
        for package in PRODUCT
        for init in (ROOT / package).rglob("__init__.py")
        if "migrations" not in init.parts
    )


def test_every_package_says_what_lives_in_it() -> None:
    silent = [
        str(folder.relative_to(ROOT))
        for folder in packages()
        if ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) is None
    ]
    assert silent == []


def test_no_folder_is_an_outlier_in_modules() -> None:
    crowded = {
        str(folder.relative_to(ROOT)): count
        for folder in packages()
        if (count := sum(1 for p in folder.glob("*.py") if p.name != "__init__.py"))
        > MAX_MODULES_PER_FOLDER
    }
    assert crowded == {}


# "Redis or in process" is decided once: by the transport, from the settings. Only these read
# the setting (the settings define it; ``ratchet dev`` sets up the process it describes), and
# only the transport makes Redis clients, with its one set of timeouts.
READS_EMBEDDED = ("shared/settings.py", "shared/transport/", "ratchet/embedded.py")
MAKES_REDIS_CLIENTS = ("shared/transport/",)


def names_used(path: Path, *, called: bool) -> list[tuple[str, int]]:
    """The attributes a module reads (``settings.embedded``), or with ``called`` the names
    and attributes it calls (``Redis.from_url(...)``, ``Redis(...)``), with their lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if called and isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            found.append((name, node.lineno))
        elif not called and isinstance(node, ast.Attribute):
            found.append((node.attr, node.lineno))
    return found


def outside(allowed: tuple[str, ...], names: set[str], *, called: bool) -> list[str]:
    return [
        f"{where}:{line} {name}"
        for path in product_modules()
        if not (where := str(path.relative_to(ROOT))).startswith(allowed)
        for name, line in names_used(path, called=called)
        if name in names
    ]


def test_only_the_transport_settings_and_the_dev_runner_ask_whether_embedded() -> None:
    assert outside(READS_EMBEDDED, {"embedded"}, called=False) == []


def test_only_the_transport_makes_redis_clients() -> None:
    clients = {"from_url", "Redis", "StrictRedis"}
    assert outside(MAKES_REDIS_CLIENTS, clients, called=True) == []


# The kind of database is decided once, by the store's backends: no other module asks which
# it is (the settings check a URL's scheme; the tables name PostgreSQL's JSONB, as the
# migrations do).
KNOWS_THE_DATABASE = ("shared/store/backends/", "shared/settings.py", "shared/store/tables.py")


def test_only_the_store_backends_ask_which_database_it_is() -> None:
    asks = outside(KNOWS_THE_DATABASE, {"dialect"}, called=False)
    asks += outside(KNOWS_THE_DATABASE, {"get_backend_name"}, called=True)
    asks += [
        f"{where} imports {module}"
        for path in product_modules()
        if not (where := str(path.relative_to(ROOT))).startswith(KNOWS_THE_DATABASE)
        for module in imported_modules(path)
        if module.startswith("sqlalchemy.dialects")
    ]
    assert asks == []


def updates_of_the_task_row(path: Path) -> list[int]:
    """The lines where a module builds an UPDATE of the task table (``update(Task)``)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", "")) == "update"
        and node.args
        and getattr(node.args[0], "id", "") in {"Task", "TASKS"}
    ]


def test_only_the_store_updates_the_task_row() -> None:
    """One write path per row type: whoever changes a task says what happened through the
    store's operations (shared/store/tasks.py, leases.py, step_write.py), which own its columns."""
    elsewhere = [
        f"{where}:{line}"
        for path in product_modules()
        if not (where := str(path.relative_to(ROOT))).startswith("shared/store/")
        for line in updates_of_the_task_row(path)
    ]
    assert elsewhere == []


# A module's name says what it holds, so no two product modules (or packages) share one,
# except one resource seen from its layers: its HTTP routes (api/routes/), its HTTP schemas
# (api/schemas/) and its use cases (shared/actions/) are named for the resource, as is at most
# one domain home behind them (shared/store/tasks.py, shared/ops/fleet.py, shared/webhooks/…).
RESOURCE_LAYERS = ("api/routes", "api/schemas", "shared/actions")
# Names that mean the same thing wherever they appear: ``base`` is the interface of a family
# whose implementations sit beside it (workers/providers/, shared/transport/).
PARALLEL_NAMES = frozenset({"base"})


def homes_by_name() -> dict[str, list[str]]:
    homes: dict[str, list[str]] = {}
    modules = [path for path in product_modules() if path.name != "__init__.py"]
    folders = {path.parent for path in product_modules()} - {ROOT / p for p in PRODUCT}
    for path in [*modules, *folders]:
        folder = str(path.parent.relative_to(ROOT))
        homes.setdefault(path.stem, []).append(folder)
    return homes


def test_no_two_modules_share_a_name_but_one_resources_layers() -> None:
    confusable = {
        name: sorted(folders)
        for name, folders in homes_by_name().items()
        if len(folders) > 1
        and name not in PARALLEL_NAMES
        and sum(folder not in RESOURCE_LAYERS for folder in folders) > 1
    }
    assert confusable == {}


def defines_a_pydantic_model(path: Path) -> bool:
    return any(
        isinstance(node, ast.ClassDef)
        and any(isinstance(base, ast.Name) and base.id == "BaseModel" for base in node.bases)
        for node in ast.parse(path.read_text()).body
    )


def test_the_http_schemas_live_in_api_schemas() -> None:
    """A resource's request and response bodies are in api/schemas/<resource>.py; the routes
    and the dashboard import them (problem+json's own bodies stay with its handler)."""
    elsewhere = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "api").rglob("*.py"))
        if path.parent.name != "schemas" and path.name != "problems.py"
        if defines_a_pydantic_model(path)
    ]
    assert elsewhere == []


def test_every_folder_of_modules_is_a_package() -> None:
    # A folder without __init__.py is a namespace package: nothing says what lives in it, and
    # the rule above never sees it.
    bare = [
        str(folder.relative_to(ROOT))
        for package in PRODUCT
        for folder in (ROOT / package).rglob("*")
        if folder.is_dir()
        and "__pycache__" not in folder.parts
        and "migrations" not in folder.parts
        and any(folder.glob("*.py"))
        and not (folder / "__init__.py").exists()
    ]
    assert bare == []


# Unit tests mirror the product (tests/unit/shared/store/test_leases.py tests
# shared/store/leases.py), so a reader finds a module's tests by its name; a package's own
# tests are named for it (tests/unit/shared/transport/test_transport.py). Suites about the
# repository as a whole sit at the top of tests/unit/.
MIRRORED = ("shared", "workers", "api")


def names_a_product_module(test: Path) -> bool:
    """Whether ``tests/unit/<folder>/test_<name>.py`` names ``<folder>/<name>.py``, the
    package ``<folder>/<name>/``, or the package ``<folder>`` itself when it is ``<name>``."""
    folder = ROOT / test.parent.relative_to(ROOT / "tests" / "unit")
    name = test.stem.removeprefix("test_")
    return (
        (folder / f"{name}.py").is_file()
        or (folder / name / "__init__.py").is_file()
        or (folder.name == name and (folder / "__init__.py").is_file())
    )


def test_every_unit_test_module_names_the_product_module_it_tests() -> None:
    misnamed = [
        str(test.relative_to(ROOT))
        for package in MIRRORED
        for test in sorted((ROOT / "tests" / "unit" / package).rglob("test_*.py"))
        if not names_a_product_module(test)
    ]
    assert misnamed == []
