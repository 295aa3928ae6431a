"""The price table: shipped with the package, overridden and extended by RATCHET_PRICES_FILE, a
bad file refused at start in one line; a call priced with its cached and cache-write tokens,
and a model with no price costs an unknown amount, never $0."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from shared import pricing
from shared.settings import Settings, describe_invalid

Configure = Callable[..., None]


@pytest.fixture
def prices_file(tmp_path: Path, configure: Configure) -> Callable[[Any], Path]:
    """Write a prices file and point RATCHET_PRICES_FILE at it."""

    def write(document: Any) -> Path:
        path = tmp_path / "prices.json"
        path.write_text(document if isinstance(document, str) else json.dumps(document))
        configure(RATCHET_PRICES_FILE=str(path))
        return path

    return write


@pytest.fixture(autouse=True)
def _no_prices_set_in_code() -> Iterator[None]:
    yield
    pricing._added.clear()


def test_the_shipped_table_says_when_it_was_checked_and_prices_the_known_models() -> None:
    table = pricing.shipped()
    assert table.checked is not None
    for model in ("openai:gpt-4o-mini", "openai:gpt-4.1", "anthropic:claude-sonnet-4-5"):
        price = pricing.price_of(model)
        assert price is not None
        assert 0 < price.input < price.output
    # Anthropic bills cache reads at a tenth of the input price, 5-minute writes at 1.25x.
    for model, price in table.models.items():
        if model.startswith("anthropic:"):
            assert price.cached_input == pytest.approx(price.input * 0.1)
            assert price.cache_write == pytest.approx(price.input * 1.25)


def test_list_prices_per_million_tokens() -> None:
    # gpt-4o-mini lists at $0.15 in and $0.60 out per million tokens.
    cost = pricing.cost_usd("openai:gpt-4o-mini", input_tokens=280, output_tokens=25)
    assert cost == pytest.approx((280 * 0.15 + 25 * 0.60) / 1e6)


def test_cached_and_cache_write_tokens_are_billed_at_their_own_prices() -> None:
    price = pricing.price_of("anthropic:claude-sonnet-4-5")
    assert price is not None
    assert price.cached_input is not None
    assert price.cache_write is not None
    cost = pricing.cost_usd(
        "anthropic:claude-sonnet-4-5",
        input_tokens=10_000,
        output_tokens=100,
        cached_input_tokens=6_000,
        cache_write_tokens=3_000,
    )
    expected = 1_000 * price.input + 6_000 * price.cached_input + 3_000 * price.cache_write
    assert cost == pytest.approx((expected + 100 * price.output) / 1e6)
    uncached = pricing.cost_usd(
        "anthropic:claude-sonnet-4-5", input_tokens=10_000, output_tokens=100
    )
    assert uncached is not None
    assert cost is not None
    assert cost < uncached


def test_a_price_left_out_is_the_input_price(prices_file: Callable[[Any], Path]) -> None:
    prices_file({"models": {"openai:local": {"input": 1.0, "output": 2.0}}})
    plain = pricing.cost_usd("openai:local", input_tokens=1000, output_tokens=0)
    cached = pricing.cost_usd(
        "openai:local", input_tokens=1000, output_tokens=0, cached_input_tokens=1000
    )
    assert plain == cached == pytest.approx(0.001)


def test_counts_within_the_prompt_never_exceed_it() -> None:
    """A provider's odd report (more cached tokens than the prompt) never prices a token twice
    nor a negative one."""
    price = pricing.price_of("openai:gpt-4o")
    assert price is not None
    assert price.cached_input is not None
    cost = pricing.cost_usd(
        "openai:gpt-4o", input_tokens=100, output_tokens=0, cached_input_tokens=500
    )
    assert cost == pytest.approx(100 * price.cached_input / 1e6)


def test_an_unknown_model_has_no_price_and_an_unknown_cost() -> None:
    assert pricing.price_of("openai:some-local-model") is None
    assert not pricing.is_priced("openai:some-local-model")
    assert pricing.cost_usd("openai:some-local-model", input_tokens=10, output_tokens=10) is None
    assert (
        pricing.worst_case_cost("openai:some-local-model", prompt_tokens=1, output_tokens=1) is None
    )
    reason = pricing.unpriced_reason("openai:some-local-model")
    assert "RATCHET_PRICES_FILE" in reason
    assert "openai:some-local-model" in reason


def test_the_scripted_model_is_free() -> None:
    assert pricing.cost_usd("scripted", input_tokens=10**6, output_tokens=10**6) == 0.0


def test_a_prices_file_replaces_and_adds_models(prices_file: Callable[[Any], Path]) -> None:
    prices_file(
        {
            "checked": "2026-11-27",
            "models": {
                "openai:gpt-4o-mini": {"input": 1.0, "output": 1.0},
                "openai:llama-3.1-70b": {"input": 0.5, "output": 0.75, "cached_input": 0.1},
            },
        }
    )
    assert pricing.cost_usd("openai:gpt-4o-mini", input_tokens=10**6, output_tokens=0) == 1.0
    assert pricing.cost_usd("openai:llama-3.1-70b", input_tokens=0, output_tokens=10**6) == 0.75
    assert pricing.is_priced("openai:gpt-4.1")  # the rest of the shipped table stays


def test_set_price_prices_a_model_in_code_over_both_files() -> None:
    pricing.set_price("openai:mine", input_per_million=2.0, output_per_million=4.0)
    assert pricing.cost_usd("openai:mine", input_tokens=10**6, output_tokens=10**6) == 6.0


def test_the_worst_case_prices_every_prompt_token_at_the_dearer_input_price() -> None:
    price = pricing.price_of("anthropic:claude-sonnet-4-5")
    assert price is not None
    assert price.cache_write is not None
    worst = pricing.worst_case_cost(
        "anthropic:claude-sonnet-4-5", prompt_tokens=1000, output_tokens=500
    )
    assert worst == pytest.approx((1000 * price.cache_write + 500 * price.output) / 1e6)


@pytest.mark.parametrize(
    ("document", "told"),
    [
        ("not json", "is not valid JSON"),
        ({"models": {"openai:x": {"input": -1, "output": 1}}}, "models.openai:x.input"),
        ({"models": {"openai:x": {"input": 1}}}, "models.openai:x.output"),
        ({"models": {"openai:x": {"input": 1, "output": 1, "cahced": 1}}}, "cahced"),
        ({"prices": {}}, "models"),
    ],
    ids=["not-json", "negative", "missing", "misspelt", "no-models"],
)
def test_a_bad_prices_file_stops_the_settings_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, document: Any, told: str
) -> None:
    path = tmp_path / "prices.json"
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    monkeypatch.setenv("RATCHET_PRICES_FILE", str(path))
    with pytest.raises(ValidationError) as raised:
        Settings()
    line = describe_invalid(raised.value)
    assert line.startswith("RATCHET_PRICES_FILE: ")
    assert told in line
    assert "\n" not in line


def test_a_missing_prices_file_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RATCHET_PRICES_FILE", str(tmp_path / "nowhere.json"))
    with pytest.raises(ValidationError) as raised:
        Settings()
    assert "no such file" in describe_invalid(raised.value)
