"""Model strings: ``provider:model``, the provider one Ratchet knows."""

from __future__ import annotations

import pytest

from shared.errors import InvalidRequest
from shared.model_strings import parse_model


def test_model_strings() -> None:
    assert parse_model("openai:gpt-4o-mini") == ("openai", "gpt-4o-mini")
    assert parse_model("scripted") == ("scripted", "")
    with pytest.raises(InvalidRequest, match="unknown model provider"):
        parse_model("nope:x")
    with pytest.raises(InvalidRequest):
        parse_model("openai")
