"""A user message's content parts as a submission gives them: each checked on its own, sizes
against the settings."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from api.schemas.content import ContentPart, check_sizes, decoded_size
from api.schemas.tasks import InputMessage
from shared.errors import InvalidRequest
from shared.settings import Settings

PARTS = TypeAdapter(list[ContentPart])
WEBP = base64.b64encode(b"RIFF\x10\x00\x00\x00WEBPVP8 " + bytes(8)).decode()
GIF = base64.b64encode(b"GIF89a" + bytes(8)).decode()


@pytest.mark.parametrize(
    "part",
    [
        {"type": "text", "text": "hi"},
        {"type": "image", "url": "https://example.com/a.png"},
        {"type": "image", "url": "http://93.184.215.14/a.png"},
        {"type": "image", "data": WEBP, "media_type": "image/webp"},
        {"type": "image", "data": GIF, "media_type": "image/gif"},
        {
            "type": "file",
            "data": base64.b64encode(b"%PDF-2.0").decode(),
            "media_type": "application/pdf",
        },
        {
            "type": "file",
            "data": base64.b64encode("naïve".encode()).decode(),
            "media_type": "text/plain",
            "name": "n.txt",
        },
    ],
)
def test_a_good_part_passes(part: dict[str, Any]) -> None:
    assert PARTS.validate_python([part])[0].model_dump(exclude_none=True) == part


@pytest.mark.parametrize(
    ("part", "said"),
    [
        ({"type": "image", "data": GIF, "media_type": "image/webp"}, "data is not image/webp"),
        ({"type": "image", "url": "http://[::1]/a.png"}, "private, loopback or link-local"),
        ({"type": "image", "url": "http://10.0.0.8/a.png"}, "private, loopback or link-local"),
        ({"type": "image", "url": "ftp://example.com/a.png"}, "http or https"),
        (
            {"type": "image", "url": "https://example.com/a.png", "media_type": "image/png"},
            "media_type goes with data",
        ),
        ({"type": "image"}, "not both"),
        ({"type": "text", "text": "a\x00b"}, "NUL"),
        ({"type": "file", "data": GIF, "media_type": "image/gif"}, "Input should be"),
    ],
)
def test_a_bad_part_says_why(part: dict[str, Any], said: str) -> None:
    with pytest.raises(ValidationError) as refused:
        PARTS.validate_python([part])
    assert said in str(refused.value)


@pytest.mark.parametrize("raw", [b"", b"a", b"ab", b"abc", b"abcd", bytes(1000)])
def test_the_decoded_size_is_counted_without_decoding(raw: bytes) -> None:
    assert decoded_size(base64.b64encode(raw).decode()) == len(raw)


def _pdf(size: int) -> dict[str, Any]:
    data = base64.b64encode(b"%PDF-" + bytes(size - 5)).decode()
    return {"type": "file", "data": data, "media_type": "application/pdf"}


def test_sizes_are_checked_per_part_and_per_task() -> None:
    settings = Settings(input_part_max_bytes=2000, input_max_bytes=3000)
    fits = [
        InputMessage(role="user", content=[_pdf(2000)]),
        InputMessage(role="user", content=[_pdf(1000)]),
    ]
    check_sizes(fits, settings)
    with pytest.raises(InvalidRequest) as too_big:
        check_sizes(
            [InputMessage(role="user", content=[{"type": "text", "text": "x"}, _pdf(2001)])],
            settings,
        )
    assert too_big.value.field == "input[0].content[1].data"
    with pytest.raises(InvalidRequest) as too_much:
        check_sizes([*fits, InputMessage(role="user", content=[_pdf(10)])], settings)
    assert too_much.value.field == "input"
