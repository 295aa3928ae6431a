"""Reading a limits file (TOML) or an inline setting (JSON) into a pydantic model, with one
line that says what is wrong: the rate limits and the concurrency limits both read this way."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def parse_inline(model: type[M], text: str) -> M:
    """A JSON setting; ValueError naming what is wrong (settings validation calls it)."""
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise ValueError(first_error(exc)) from None


def parse_file(model: type[M], file: Path) -> M:
    """A TOML file; ValueError naming what is wrong."""
    try:
        loaded = tomllib.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"no such file: {file}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from None
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
