"""The docs keep their promises: the site builds with no warning (a broken link or anchor fails
it), it loads nothing from another host, the README stays a README (under 300 lines, every
relative link pointing at a file), a newcomer is told how to put ``ratchet`` on the PATH
before the first example that needs it and which tests to run while working, and the
references name every route of the OpenAPI document, every CLI command and every setting."""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300
FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
# An asset the browser would fetch from another host as the page loads (not a hyperlink).
REMOTE_ASSET = re.compile(r"<(?:script|img)[^>]+src=\"https?://|<link[^>]+href=\"https?://")
BARE_RATCHET = re.compile(
    r"(?<![\w/.-])ratchet (?:dev|api|worker|flower|migrate|tail|submit|approve|tenants|keys"
    r"|tasks|webhooks|schedules|bench)\b"
)
SNIPPET = re.compile(r'^--8<-- "(?P<file>[^":]+):(?P<section>[\w-]+)"$', re.MULTILINE)
ACTIVATE = "source .venv/bin/activate"
QUICK_SUBSET = ".venv/bin/pytest tests/unit"


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def relative_links(path: Path) -> Iterator[str]:
    """The relative link targets of a Markdown file, outside code blocks, without fragments."""
    text = FENCED.sub("", path.read_text())
    for found in LINK.finditer(text):
        target = found["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        yield target.split("#", 1)[0]


def included(text: str) -> str:
    """The page as the site shows it: each snippet line replaced by the section it names."""

    def section(found: re.Match[str]) -> str:
        source = (ROOT / found["file"]).read_text()
        start, end = f"--8<-- [start:{found['section']}]", f"--8<-- [end:{found['section']}]"
        return source[source.index(start) : source.index(end)]

    return SNIPPET.sub(section, text)


def require_mkdocs() -> None:
    if importlib.util.find_spec("mkdocs") and importlib.util.find_spec("material"):
        return
    if os.environ.get("CI") == "true":
        pytest.fail("mkdocs and mkdocs-material are in the dev extra; CI must have them")
    pytest.skip("mkdocs is not installed (pip install -e '.[dev]')")


def test_site_builds_strict_and_works_offline(tmp_path: Path) -> None:
    require_mkdocs()
    site = tmp_path / "site"
    # Material prints a notice about its future on every build; it is not about these docs.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    report = f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, report
    assert "WARNING" not in done.stderr, report
    pages = sorted(site.rglob("*.html"))
    remote = [str(p.relative_to(site)) for p in pages if REMOTE_ASSET.search(p.read_text())]
    assert remote == [], f"pages that load assets from another host: {remote}"
    # The quickstart includes the README's tour rather than a copy that could drift from it.
    assert "What is 6 times 7?" in (site / "quickstart.html").read_text()


def test_readme_is_a_readme() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file(path: Path) -> None:
    missing = [t for t in relative_links(path) if t and not (path.parent / t).exists()]
    assert missing == [], f"{path.relative_to(ROOT)} links to missing files: {missing}"


def test_readme_links_to_the_docs_site() -> None:
    linked = {t for t in relative_links(README) if t.startswith("docs/")}
    for page in ("quickstart.md", "reference/configuration.md", "roadmap.md"):
        assert f"docs/{page}" in linked


def test_configuration_reference_names_every_setting() -> None:
    from shared.settings import Settings

    reference = (DOCS / "reference" / "configuration.md").read_text()
    missing = [
        f"RATCHET_{name.upper()}"
        for name in Settings.model_fields
        if f"`RATCHET_{name.upper()}`" not in reference
    ]
    assert missing == [], f"docs/reference/configuration.md does not name {missing}"


@pytest.mark.parametrize("path", [README, DOCS / "quickstart.md"], ids=lambda p: p.name)
def test_ratchet_is_put_on_the_path_before_the_first_example_that_needs_it(path: Path) -> None:
    text = included(path.read_text())
    first_use = BARE_RATCHET.search(text)
    assert first_use, f"{path.name} shows no ratchet command"
    activate = text.find(ACTIVATE)
    assert 0 <= activate < first_use.start(), (
        f"{path.name} says `{first_use[0]}` before it says `{ACTIVATE}`"
    )


@pytest.mark.parametrize("path", [README, DOCS / "development.md"], ids=lambda p: p.name)
def test_a_quick_test_subset_and_the_browser_tests_needs_are_documented(path: Path) -> None:
    text = path.read_text()
    assert QUICK_SUBSET in text
    assert "tests/browser" in text
    assert "Chromium" in text
    assert ".ci/run" in text


def test_http_api_reference_names_every_route() -> None:
    from api.main import create_app

    page = (DOCS / "reference" / "http-api.md").read_text()
    paths = create_app().openapi()["paths"]
    routes = [f"{method.upper()} {path}" for path, ops in paths.items() for method in ops]
    missing = [route for route in routes if f"`{route}`" not in page]
    assert missing == [], f"docs/reference/http-api.md does not name {missing}"


def cli_commands(command: object, prefix: str) -> Iterator[str]:
    """Every command a user can see in --help (hidden aliases left out), as typed."""
    subcommands = getattr(command, "commands", {})
    if not subcommands:
        yield prefix
    for name, sub in subcommands.items():
        if not getattr(sub, "hidden", False):
            yield from cli_commands(sub, f"{prefix} {name}")


def test_cli_reference_names_every_command() -> None:
    from ratchet.cli import app

    page = (DOCS / "reference" / "cli.md").read_text()
    commands = list(cli_commands(typer.main.get_command(app), "ratchet"))
    missing = [c for c in commands if not re.search(rf"`{re.escape(c)}(?:[ `])", page)]
    assert missing == [], f"docs/reference/cli.md does not name {missing}"


def test_benchmark_history_is_data() -> None:
    with (DOCS / "benchmarks" / "history.csv").open(newline="") as f:
        rows = list(csv.DictReader(f, strict=True))
    assert rows
    assert list(rows[0]) == ["benchmark", "run", "figure", "baseline", "ratio"]
    method = (DOCS / "benchmarks" / "index.md").read_text()
    for row in rows:
        assert None not in row, f"a row with too many fields: {row}"
        assert None not in row.values(), f"a row with too few fields: {row}"
        assert f"`ratchet bench {row['benchmark']}`" in method, f"an unknown benchmark: {row}"
