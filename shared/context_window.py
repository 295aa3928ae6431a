"""The context window: how many tokens each model reads at most, and the policy that keeps a
task's prompt inside it with room for the answer.

A model's window is, in this order: its entry in ``RATCHET_MODEL_CONTEXT_WINDOWS`` (by its
whole model string, ``openai:my-model``), the table of known models below (by the longest
prefix of the model's name), or ``RATCHET_DEFAULT_CONTEXT_WINDOW``.

A task's policy is its submission's ``context``, else its agent's, else
``RATCHET_CONTEXT_POLICY``; the submission stores it resolved (``tasks.context``), so a task
keeps the policy it was submitted with:

- ``truncate``: the system prompt, the first user message and the most recent turns;
- ``summarize``: older turns compressed into a committed summary (``context.model``, if
  given, writes it);
- ``off``: a prompt over the window fails the task with ``context_length_exceeded``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from shared.errors import InvalidRequest
from shared.model_strings import parse_model
from shared.settings import Settings

# Context windows in tokens, by the longest prefix of the model's name (what the providers
# publish; an operator's RATCHET_MODEL_CONTEXT_WINDOWS wins over them).
KNOWN_WINDOWS: dict[str, dict[str, int]] = {
    "openai": {
        "gpt-3.5-turbo": 16_385,
        "gpt-4": 8_192,
        "gpt-4-32k": 32_768,
        "gpt-4-turbo": 128_000,
        "gpt-4-1106": 128_000,
        "gpt-4-0125": 128_000,
        "gpt-4o": 128_000,
        "chatgpt-4o": 128_000,
        "gpt-4.1": 1_047_576,
        "gpt-4.5": 128_000,
        "gpt-5": 400_000,
        "gpt-5-chat": 128_000,
        "o1": 200_000,
        "o1-mini": 128_000,
        "o1-preview": 128_000,
        "o3": 200_000,
        "o3-mini": 200_000,
        "o4-mini": 200_000,
    },
    "anthropic": {
        "claude-": 200_000,
        "claude-2.0": 100_000,
        "claude-instant": 100_000,
    },
}


class Policy(StrEnum):
    """How a prompt that would overflow the window is kept inside it."""

    TRUNCATE = "truncate"
    SUMMARIZE = "summarize"
    OFF = "off"


@dataclass(frozen=True)
class ContextPolicy:
    """A task's context policy: ``model`` writes the summaries (default: the task's own);
    ``reserve_tokens`` is the room kept for the answer (default: the call's ``max_tokens``,
    else ``RATCHET_CONTEXT_RESERVE_TOKENS`` up to a quarter of the window)."""

    policy: Policy
    model: str | None = None
    reserve_tokens: int | None = None

    def as_json(self) -> dict[str, Any]:
        """As ``tasks.context`` stores it."""
        data: dict[str, Any] = {"policy": str(self.policy)}
        if self.model is not None:
            data["model"] = self.model
        if self.reserve_tokens is not None:
            data["reserve_tokens"] = self.reserve_tokens
        return data


def check_context(context: dict[str, Any]) -> None:
    """Raise ValueError unless ``context`` is a policy as a submission gives it (an agent's,
    checked when it is registered): ``policy``, ``model`` and ``reserve_tokens``, each
    optional."""
    unknown = set(context) - {"policy", "model", "reserve_tokens"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}: policy, model, reserve_tokens")
    if context.get("policy") is not None and context["policy"] not in set(Policy):
        raise ValueError(f"policy must be truncate, summarize or off, not {context['policy']!r}")
    if context.get("model") is not None:
        try:
            parse_model(str(context["model"]))
        except InvalidRequest as exc:
            raise ValueError(exc.reason) from None
    reserve = context.get("reserve_tokens")
    if reserve is not None and (not isinstance(reserve, int) or reserve < 1):
        raise ValueError(f"reserve_tokens must be a positive integer, not {reserve!r}")


def context_window(model: str, settings: Settings) -> int:
    """The window of ``model`` (``provider:name``) in tokens."""
    configured = settings.model_context_windows.get(model)
    if configured is not None:
        return configured
    provider, name = parse_model(model)
    known = KNOWN_WINDOWS.get(provider, {})
    matches = [prefix for prefix in known if name.startswith(prefix)]
    if matches:
        return known[max(matches, key=len)]
    return settings.default_context_window


def policy_of(stored: dict[str, Any] | None, settings: Settings) -> ContextPolicy:
    """The policy ``tasks.context`` holds; a task submitted before it was stored (None) has
    the server's default."""
    stored = stored or {}
    return ContextPolicy(
        policy=Policy(stored.get("policy") or settings.context_policy),
        model=stored.get("model"),
        reserve_tokens=stored.get("reserve_tokens"),
    )


def answer_room(
    policy: ContextPolicy, options: dict[str, Any], *, window: int, settings: Settings
) -> int:
    """The tokens kept free for the model's answer: what the policy reserves, else the most
    the call may write, else the setting (at most a quarter of the window) and the extended
    thinking budget the call asks for (Anthropic counts it within the answer's)."""
    if policy.reserve_tokens is not None:
        return policy.reserve_tokens
    asked = options.get("max_tokens") or options.get("max_completion_tokens")
    if isinstance(asked, int) and asked > 0:
        return asked
    thinking = options.get("thinking")
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    extra = budget if isinstance(budget, int) and budget > 0 else 0
    return min(settings.context_reserve_tokens, window // 4) + extra
