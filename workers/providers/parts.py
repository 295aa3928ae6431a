"""A message's content parts (text, images, files) in each provider's wire format, and what
they weigh in tokens before a call.

Parts come from a task's input as the submission checked them (``api.schemas.content``):
``{"type": "text", "text"}``, ``{"type": "image", "url"}`` or ``{"type": "image", "data",
"media_type"}``, and ``{"type": "file", "data", "media_type", "name"?}``. A message whose
content is a string is sent as it is.
"""

from __future__ import annotations

import base64
from typing import Any

from workers.providers.base import estimate_tokens

# What a part other than text costs in the prompt, estimated before the call (the provider's
# usage corrects it after): an image of about a megapixel, at either provider; a file, by its
# size (a PDF's pages are read as text and as images).
IMAGE_TOKENS = 1_600
FILE_BYTES_PER_TOKEN = 50


def text_of(content: Any) -> str:
    """The text of a message's content: the string, or its text parts, one per line."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if p.get("type") == "text")


def media_tokens(content: Any) -> int:
    """About what a message's images and files cost in the prompt (0 for a string)."""
    if not isinstance(content, list):
        return 0
    tokens = 0
    for part in content:
        if part.get("type") == "image":
            tokens += IMAGE_TOKENS
        elif part.get("type") == "file":
            tokens += max(1, len(part.get("data", "")) * 3 // 4 // FILE_BYTES_PER_TOKEN)
    return tokens


def estimated_tokens(content: Any) -> int:
    """About what a message's content costs in the prompt, where no tokenizer applies."""
    return estimate_tokens(text_of(content)) + media_tokens(content)


def to_openai(content: Any) -> Any:
    """Content as chat completions take it: ``text``, ``image_url`` (a URL, or the data as a
    ``data:`` URL) and ``file`` (a PDF as ``file_data``) parts. A plain-text file, which chat
    completions do not take, is sent as a text part headed by its name."""
    if not isinstance(content, list):
        return content or ""
    return [_openai_part(part) for part in content]


def _openai_part(part: dict[str, Any]) -> dict[str, Any]:
    kind = part["type"]
    if kind == "image":
        url = part.get("url") or f"data:{part['media_type']};base64,{part['data']}"
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "file" and part["media_type"] != "text/plain":
        file = {"file_data": f"data:{part['media_type']};base64,{part['data']}"}
        return {"type": "file", "file": file | {"filename": part.get("name") or "file.pdf"}}
    if kind == "file":
        return {"type": "text", "text": _headed(part)}
    return {"type": "text", "text": part["text"]}


def to_anthropic(content: Any) -> Any:
    """Content as the Messages API takes it: ``text``, ``image`` (a ``url`` or ``base64``
    source) and ``document`` blocks (a PDF in base64, plain text as text), a file's name as
    the document's title."""
    if not isinstance(content, list):
        return content or ""
    return [_anthropic_part(part) for part in content]


def _anthropic_part(part: dict[str, Any]) -> dict[str, Any]:
    kind = part["type"]
    if kind == "image":
        if part.get("url"):
            return {"type": "image", "source": {"type": "url", "url": part["url"]}}
        source = {"type": "base64", "media_type": part["media_type"], "data": part["data"]}
        return {"type": "image", "source": source}
    if kind == "file":
        if part["media_type"] == "text/plain":
            text = base64.b64decode(part["data"]).decode()
            source = {"type": "text", "media_type": "text/plain", "data": text}
        else:
            source = {"type": "base64", "media_type": part["media_type"], "data": part["data"]}
        block = {"type": "document", "source": source}
        return block | ({"title": part["name"]} if part.get("name") else {})
    return {"type": "text", "text": part["text"]}


def _headed(part: dict[str, Any]) -> str:
    text = base64.b64decode(part["data"]).decode()
    return f"{part['name']}:\n{text}" if part.get("name") else text
