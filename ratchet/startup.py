"""What every Ratchet process checks before it starts: its settings, all of them."""

from __future__ import annotations

import sys

from pydantic import ValidationError
from pydantic_settings import SettingsError

from shared.settings import Settings, describe_invalid


def require_valid_settings() -> None:
    """Read every setting (rate limits and their file included) or stop the process with one
    line on stderr naming what is wrong: a bad setting found later would fail each request
    or each step instead."""
    try:
        Settings()  # not the cached copy: a command may still change the environment
    except (ValidationError, SettingsError) as exc:
        sys.stderr.write(f"ratchet: invalid settings: {describe_invalid(exc)}\n")
        raise SystemExit(2) from None
