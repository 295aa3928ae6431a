"""List prices in USD per million tokens, for ``usage.cost_usd`` and ``budget.max_cost_usd``.

Unknown models cost 0: set the price in a custom agent module with :func:`set_price`.
"""

from __future__ import annotations

PRICES: dict[str, tuple[float, float]] = {
    "openai:gpt-4o": (2.50, 10.00),
    "openai:gpt-4o-mini": (0.15, 0.60),
    "openai:gpt-4.1": (2.00, 8.00),
    "openai:gpt-4.1-mini": (0.40, 1.60),
    "openai:gpt-4.1-nano": (0.10, 0.40),
    "anthropic:claude-3-5-haiku-latest": (0.80, 4.00),
    "anthropic:claude-sonnet-4-0": (3.00, 15.00),
    "anthropic:claude-opus-4-0": (15.00, 75.00),
}


def set_price(model: str, *, input_per_million: float, output_per_million: float) -> None:
    PRICES[model] = (input_per_million, output_per_million)


def cost_usd(model: str, *, input_tokens: int, output_tokens: int) -> float:
    price_in, price_out = PRICES.get(model, (0.0, 0.0))
    return (input_tokens * price_in + output_tokens * price_out) / 1_000_000
