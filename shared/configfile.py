"""Reading a settings file or an inline setting into a pydantic model, with one line that says
what is wrong: the rate limits and the concurrency limits (TOML files, JSON settings), the MCP
servers and the prices (JSON files) all read this way."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def parse_inline(model: type[M], text: str) -> M:
    """A JSON setting; ValueError naming what is wrong (settings validation calls it)."""
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise ValueError(first_error(exc)) from None


def read_text(file: Path) -> str:
    """A settings file's text; ValueError naming what is wrong (missing, unreadable)."""
    try:
        return file.read_text()
    except FileNotFoundError:
        raise ValueError(f"no such file: {file}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from None


def read_json(file: Path) -> tuple[str, Any]:
    """A JSON settings file's text and value; ValueError naming what is wrong."""
    text = read_text(file)
    try:
        return text, json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from None


def parse_file(model: type[M], file: Path) -> M:
    """A TOML file; ValueError naming what is wrong."""
    text = read_text(file)
    try:
        loaded = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{file} is not valid TOML: {exc}") from None
    try:
        return model.model_validate(loaded)
    except ValidationError as exc:
        raise ValueError(f"{file}: {first_error(exc)}") from None


def first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else error["msg"]
