"""Content parts in each provider's wire format, and their weight before a call."""

from __future__ import annotations

import base64
from typing import Any

from workers.providers import parts
from workers.providers.base import estimate_tokens

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(8)).decode()
PDF = base64.b64encode(b"%PDF-1.7\n" + bytes(5000)).decode()
TEXT = base64.b64encode("héllo".encode()).decode()
CONTENT: list[dict[str, Any]] = [
    {"type": "text", "text": "one"},
    {"type": "image", "url": "https://example.com/a.png"},
    {"type": "image", "data": PNG, "media_type": "image/png"},
    {"type": "file", "data": PDF, "media_type": "application/pdf"},
    {"type": "file", "data": TEXT, "media_type": "text/plain", "name": "a.txt"},
    {"type": "text", "text": "two"},
]


def test_a_string_passes_through_both_ways() -> None:
    assert parts.to_openai("hi") == parts.to_anthropic("hi") == "hi"
    assert parts.to_openai(None) == parts.to_anthropic(None) == ""


def test_openai_gets_image_url_and_file_parts() -> None:
    assert parts.to_openai(CONTENT) == [
        {"type": "text", "text": "one"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        {
            "type": "file",
            "file": {"file_data": f"data:application/pdf;base64,{PDF}", "filename": "file.pdf"},
        },
        {"type": "text", "text": "a.txt:\nhéllo"},
        {"type": "text", "text": "two"},
    ]


def test_anthropic_gets_image_and_document_blocks() -> None:
    assert parts.to_anthropic(CONTENT) == [
        {"type": "text", "text": "one"},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": PDF},
        },
        {
            "type": "document",
            "source": {"type": "text", "media_type": "text/plain", "data": "héllo"},
            "title": "a.txt",
        },
        {"type": "text", "text": "two"},
    ]


def test_a_part_weighs_its_text_or_an_estimate_never_its_base64() -> None:
    assert parts.text_of(CONTENT) == "one\ntwo"
    assert parts.text_of(None) == ""
    assert parts.media_tokens("a string") == 0
    pdf_tokens = (len(PDF) * 3 // 4) // parts.FILE_BYTES_PER_TOKEN
    expected = 2 * parts.IMAGE_TOKENS + pdf_tokens + 1
    assert parts.media_tokens(CONTENT) == expected
    assert parts.estimated_tokens(CONTENT) == estimate_tokens("one\ntwo") + expected
    assert parts.estimated_tokens([CONTENT[3]]) < estimate_tokens(PDF) // 10
