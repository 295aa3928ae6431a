"""Workspaces: named after task ids only, listed without following links, removed whole."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.errors import ToolError
from shared.sandbox import workspaces


@pytest.mark.parametrize("task_id", ["", "..", "../etc", "a/b", ".probe", "x" * 200])
def test_a_workspace_is_named_after_a_task_id_alone(task_id: str) -> None:
    with pytest.raises(ToolError):
        workspaces.path_of(task_id)


def test_listing_names_regular_files_and_follows_no_link(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "data.csv").write_text("a,b\n")
    (tmp_path / "notes.txt").write_text("hi")
    os.symlink("/etc", tmp_path / "etc")
    os.symlink("/etc/hostname", tmp_path / "hostname")

    assert workspaces.listing(tmp_path) == [
        {"name": "notes.txt", "size": 2},
        {"name": "out/data.csv", "size": 4},
    ]


def test_listing_names_at_most_the_first_files(tmp_path: Path) -> None:
    for n in range(workspaces.MAX_LISTED_FILES + 20):
        (tmp_path / f"{n:04}").touch()

    listed = workspaces.listing(tmp_path)

    assert [f["name"] for f in listed] == [f"{n:04}" for n in range(workspaces.MAX_LISTED_FILES)]


def test_a_workspace_is_removed_whole_even_when_code_locked_its_directories(
    tmp_path: Path,
) -> None:
    locked = tmp_path / "task-1" / "a" / "b"
    locked.mkdir(parents=True)
    (locked / "f").write_text("x")
    (tmp_path / "task-1" / "a").chmod(0)

    workspaces.remove_path(tmp_path / "task-1")

    assert not (tmp_path / "task-1").exists()
