"""What a model call costs, for ``usage.cost_usd`` and ``budget.max_cost_usd``.

Prices are list prices in USD per million tokens, kept in one data file shipped with the
package (``shared/prices.json``): per model string, ``input`` and ``output``, and where the
provider bills prompt-cache reads and writes apart, ``cached_input`` and ``cache_write``.
``RATCHET_PRICES_FILE`` names a file of the same form; each model it lists replaces the
shipped entry or adds one. An extension module may add prices in code with
:func:`set_price`.

A model that is in neither has no known price: its cost is unknown (``None``), never a $0 that
would let a cost budget run forever, and a task with ``budget.max_cost_usd`` on it is refused
at submission (see :func:`unpriced_reason`).

Token counts follow Ratchet's usage: ``input_tokens`` is the whole prompt, with the tokens read
from the provider's prompt cache (``cached_input_tokens``) and those written to it
(``cache_write_tokens``) among them; ``output_tokens`` includes any reasoning tokens, which
providers bill as output.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.configfile import first_error, read_json
from shared.settings import get_settings

SHIPPED = "prices.json"
ROUNDING = 12  # a cost is a sum of small floats: keep it from growing float noise


class Price(BaseModel):
    """One model's list prices, USD per million tokens. A cached or cache-write price left
    out is the input price (a provider that bills no discount, or reports no such tokens)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    input: float = Field(ge=0)
    output: float = Field(ge=0)
    cached_input: float | None = Field(None, ge=0)
    cache_write: float | None = Field(None, ge=0)


class PriceTable(BaseModel):
    """A prices file: ``models`` by model string (``openai:gpt-4o``, ``anthropic:…``), with
    when they were last checked against the providers' pages."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checked: str | None = Field(None, description="the date the prices were last checked")
    source: str | None = None
    models: dict[str, Price]


_added: dict[str, Price] = {}  # by set_price, over both files
_added_lock = threading.Lock()


def load_file(path: Path) -> PriceTable:
    """A prices file; ValueError in one line naming what is wrong with it."""
    _, data = read_json(path)
    try:
        return PriceTable.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{path}: {first_error(exc)}") from None


@lru_cache(maxsize=1)
def shipped() -> PriceTable:
    """The table shipped with the package."""
    text = resources.files("shared").joinpath(SHIPPED).read_text()
    return PriceTable.model_validate_json(text)


@lru_cache(maxsize=4)
def _table(path: Path | None) -> dict[str, Price]:
    models = dict(shipped().models)
    if path is not None:
        models.update(load_file(path).models)
    return models


def price_of(model: str) -> Price | None:
    """``model``'s prices (``provider:name``), or None when no price is known."""
    found = _added.get(model)
    if found is not None:
        return found
    return _table(get_settings().prices_file).get(model)


def is_priced(model: str) -> bool:
    return price_of(model) is not None


def set_price(
    model: str,
    *,
    input_per_million: float,
    output_per_million: float,
    cached_input_per_million: float | None = None,
    cache_write_per_million: float | None = None,
) -> None:
    """Price ``model`` in this process, over both files: for an extension module (one that
    ``RATCHET_AGENT_MODULES`` imports in the API and the workers alike)."""
    price = Price(
        input=input_per_million,
        output=output_per_million,
        cached_input=cached_input_per_million,
        cache_write=cache_write_per_million,
    )
    with _added_lock:
        _added[model] = price


def cost_usd(
    model: str,
    *,
    input_tokens: int,
    output_tokens: int,
    cached_input_tokens: int = 0,
    cache_write_tokens: int = 0,
) -> float | None:
    """The call's cost at list prices, or None when ``model`` has no known price.

    ``input_tokens`` is the whole prompt: the cached and cache-written tokens among them are
    billed at their own prices, the rest at the input price."""
    price = price_of(model)
    if price is None:
        return None
    cached = min(cached_input_tokens, input_tokens)
    written = min(cache_write_tokens, input_tokens - cached)
    plain = input_tokens - cached - written
    total = (
        plain * price.input
        + cached * _or(price.cached_input, price.input)
        + written * _or(price.cache_write, price.input)
        + output_tokens * price.output
    )
    return round(total / 1_000_000, ROUNDING)


def worst_case_cost(model: str, *, prompt_tokens: int, output_tokens: int) -> float | None:
    """The most a call of ``prompt_tokens`` and up to ``output_tokens`` may cost: every prompt
    token at the dearer of the input and cache-write prices (nothing known to be cached yet)."""
    price = price_of(model)
    if price is None:
        return None
    per_input = max(price.input, _or(price.cache_write, price.input))
    return round((prompt_tokens * per_input + output_tokens * price.output) / 1_000_000, ROUNDING)


def unpriced_reason(model: str) -> str:
    """What a client is told when a cost budget names a model with no known price."""
    return (
        f"{model} has no known price, so a cost budget could never be kept: price it in the "
        "file RATCHET_PRICES_FILE names (USD per million tokens: input, output, cached_input, "
        "cache_write), or use budget.max_tokens"
    )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value
