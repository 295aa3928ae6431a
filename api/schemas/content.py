"""The content parts of a user message in a task's ``input``: text, images and files.

An image is a URL the model provider fetches (Ratchet never does), or base64 data with its
media type; a file is base64 data (a PDF, or plain text). Each part is checked here: the type
and media type known, the base64 valid, its bytes what its media type says (a PNG starts as
PNG files do), and a URL's scheme and, when it is an IP address, a public one. How large a
part and a task's parts may be are settings (``RATCHET_INPUT_PART_MAX_BYTES``,
``RATCHET_INPUT_MAX_BYTES``), checked at submission (``api.submission``).
"""

from __future__ import annotations

import binascii
import ipaddress
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.schemas.fields import ShortText, Text
from shared.errors import InvalidRequest
from shared.webhooks.egress import is_public

if TYPE_CHECKING:
    from shared.settings import Settings

ImageType = Literal["image/png", "image/jpeg", "image/gif", "image/webp"]
FileType = Literal["application/pdf", "text/plain"]
BASE64 = "^[A-Za-z0-9+/]*={0,2}$"
MAX_URL_CHARS = 2048


class TextPart(BaseModel):
    """Text."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: Annotated[Text, Field(max_length=200_000)]


class ImagePart(BaseModel):
    """An image: ``url`` (http or https; the model provider fetches it), or ``data`` (base64,
    no line breaks) with its ``media_type``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "oneOf": [{"required": ["url"]}, {"required": ["data", "media_type"]}],
            "examples": [
                {"type": "image", "url": "https://example.com/receipt.png"},
                {"type": "image", "data": "iVBORw0KGgo…", "media_type": "image/png"},
            ],
        },
    )

    type: Literal["image"]
    url: Annotated[Text, Field(min_length=1, max_length=MAX_URL_CHARS)] | None = None
    data: Annotated[str, Field(min_length=4, pattern=BASE64)] | None = Field(
        None, description="the image's bytes in base64"
    )
    media_type: ImageType | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ImagePart:
        if (self.url is None) == (self.data is None):
            raise ValueError("give the image's url or its data, not both")
        if self.url is not None:
            if self.media_type is not None:
                raise ValueError("media_type goes with data; an image url has its own")
            _check_url(self.url)
            return self
        if self.media_type is None:
            raise ValueError("data needs its media_type")
        _check_data(self.data or "", self.media_type)
        return self


class FilePart(BaseModel):
    """A file, for providers that read files (both do: a PDF; Anthropic also plain text):
    its bytes in base64 (no line breaks), its media type and, optionally, its name."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "type": "file",
                    "data": "JVBERi0xLjcK…",
                    "media_type": "application/pdf",
                    "name": "invoice.pdf",
                }
            ]
        },
    )

    type: Literal["file"]
    data: Annotated[str, Field(min_length=4, pattern=BASE64)]
    media_type: FileType
    name: ShortText | None = None

    @model_validator(mode="after")
    def _valid_data(self) -> FilePart:
        _check_data(self.data, self.media_type)
        return self


ContentPart = Annotated[TextPart | ImagePart | FilePart, Field(discriminator="type")]


def decoded_size(data: str) -> int:
    """The bytes that valid base64 ``data`` holds, counted without decoding it."""
    return len(data) // 4 * 3 - len(data) + len(data.rstrip("="))


# What a file of each media type starts with (a WebP: RIFF, four bytes of size, WEBP).
SIGNATURES: dict[str, tuple[bytes, ...]] = {
    "image/png": (b"\x89PNG\r\n\x1a\n",),
    "image/jpeg": (b"\xff\xd8\xff",),
    "image/gif": (b"GIF87a", b"GIF89a"),
    "application/pdf": (b"%PDF-",),
}


def _check_data(data: str, media_type: str) -> None:
    try:
        raw = binascii.a2b_base64(data, strict_mode=True)
    except binascii.Error as exc:
        raise ValueError(f"data is not valid base64 ({exc})") from None
    if media_type == "text/plain":
        try:
            raw.decode()
        except UnicodeDecodeError:
            raise ValueError("data of text/plain must be UTF-8 text") from None
        return
    if media_type == "image/webp":
        fits = raw[:4] == b"RIFF" and raw[8:12] == b"WEBP"
    else:
        fits = raw.startswith(SIGNATURES[media_type])
    if not fits:
        raise ValueError(f"data is not {media_type}: its bytes do not start as such a file's do")


def _check_url(url: str) -> None:
    """An http(s) URL; an IP address as its host must be a public one. A host name is the
    provider's to resolve: Ratchet never fetches the image."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("url must be an http or https URL")
    host = parts.hostname
    if host == "localhost" or host.endswith(".localhost"):
        raise ValueError("url must not point at a local address")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return
    if not is_public(address):
        raise ValueError("url must not point at a private, loopback or link-local address")


def check_sizes(messages: Sequence[Any], settings: Settings) -> None:
    """Refuse (``InvalidRequest``) a part over ``RATCHET_INPUT_PART_MAX_BYTES``, or parts
    over ``RATCHET_INPUT_MAX_BYTES`` in all (decoded sizes; a URL counts nothing)."""
    total = 0
    for m, message in enumerate(messages):
        for p, part in enumerate(message.content if isinstance(message.content, list) else ()):
            data = getattr(part, "data", None)
            if data is None:
                continue
            size = decoded_size(data)
            if size > settings.input_part_max_bytes:
                raise InvalidRequest(
                    f"input[{m}].content[{p}].data",
                    f"is {size} bytes; at most {settings.input_part_max_bytes} "
                    "(RATCHET_INPUT_PART_MAX_BYTES)",
                )
            total += size
            if total > settings.input_max_bytes:
                raise InvalidRequest(
                    "input",
                    f"its images and files are over {settings.input_max_bytes} bytes in all "
                    "(RATCHET_INPUT_MAX_BYTES)",
                )


def text_or_list(value: Any) -> str:
    """Which member of a text-or-list union a value is, so that a bad list reports only its
    own errors (not also that it is no string)."""
    return "parts" if isinstance(value, list) else "text"
