"""What every Ratchet process checks before it starts: its settings, all of them, and for the
processes that run tasks the agent modules they name and the default model they would use."""

from __future__ import annotations

import sys

from pydantic import ValidationError
from pydantic_settings import SettingsError

from shared.errors import InvalidRequest
from shared.settings import Settings, describe_invalid, get_settings


def require_valid_settings() -> None:
    """Read every setting (rate limits and their file included) or stop the process with one
    line on stderr naming what is wrong: a bad setting found later would fail each request
    or each step instead."""
    try:
        Settings()  # not the cached copy: a command may still change the environment
    except (ValidationError, SettingsError) as exc:
        stop(describe_invalid(exc))


def stop(problem: str) -> None:
    """End the process before it serves anything: one line naming the setting, exit 2."""
    sys.stderr.write(f"ratchet: invalid settings: {' '.join(problem.split())}\n")
    raise SystemExit(2) from None


def require_agent_modules() -> None:
    """Import each module of ``RATCHET_AGENT_MODULES`` now, or stop with one line naming the
    setting and the module: found later, a typo would surface as a traceback from inside the
    server, after it had said it was running."""
    from shared.agents.registry import load

    load()  # the built-in tools, which any agent module may name
    for module in get_settings().agent_modules:
        try:
            load([module])
        except ModuleNotFoundError as exc:
            stop(f"RATCHET_AGENT_MODULES: {_not_found(module, exc.name or '')}")
        except Exception as exc:  # any error of the user's module is told, in one line
            stop(f"RATCHET_AGENT_MODULES: {module!r} failed to import: {type(exc).__name__}: {exc}")


def _not_found(module: str, missing: str) -> str:
    if module == missing or module.startswith(f"{missing}."):
        return (
            f"no module named {missing!r}: check the name, and run from the folder that holds "
            "it with PYTHONPATH=. (or install it)"
        )
    return f"{module!r} imports {missing!r}, which is not installed"


def warn_if_no_default_model() -> None:
    """Say at start, in one line, when a task that names no model would be refused: the
    default model (``RATCHET_DEFAULT_MODEL``, else ``scripted``) is one this server cannot
    call. The server still starts: clients that name their model are served."""
    from shared.model_strings import check_available, parse_model

    settings = get_settings()
    provider, _ = parse_model(settings.default_model)
    try:
        check_available(provider, settings)
    except InvalidRequest as exc:
        origin = (
            "RATCHET_DEFAULT_MODEL"
            if "default_model" in settings.model_fields_set
            else "the default model (RATCHET_DEFAULT_MODEL is not set)"
        )
        sys.stderr.write(
            f"ratchet: warning: {origin} is {settings.default_model!r}, which this server cannot "
            f"call ({exc.reason}): a task that names no model will be refused. Set "
            "RATCHET_DEFAULT_MODEL to a model you have configured, e.g. openai:gpt-4o-mini\n"
        )
