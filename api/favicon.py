"""The icon a browser asks every page's host for (``/favicon.ico``): a 16×16 ratchet's teeth,
drawn here and encoded as an ICO in memory, so no file ships and no page waits on a 404."""

from __future__ import annotations

import struct
from functools import cache

from fastapi import FastAPI
from fastapi.responses import Response

# "#" the wheel, "o" its teeth's light faces, "." transparent; top row first.
PIXELS = (
    "................",
    ".##############.",
    ".#oo#oo#oo#oo##.",
    ".#ooo#ooo#ooo##.",
    ".#oooo#ooo#ooo#.",
    ".##############.",
    ".##############.",
    ".######oo######.",
    ".#####oooo#####.",
    ".######oo######.",
    ".##############.",
    ".##############.",
    ".#oo#oo#oo#oo##.",
    ".#ooo#ooo#ooo##.",
    ".##############.",
    "................",
)
COLOURS = {"#": (0x1F, 0x29, 0x37, 0xFF), "o": (0xF9, 0xFA, 0xFB, 0xFF), ".": (0, 0, 0, 0)}
SIZE = 16
ICO_HEADER_BYTES = 6 + 16  # the file's header and its one directory entry


@cache
def icon() -> bytes:
    """The ICO file: one 32-bit image, rows bottom-up as BMP keeps them, and an all-clear AND
    mask (the alpha channel says what is transparent)."""
    rows = [
        b"".join(bytes((b, g, r, a)) for r, g, b, a in (COLOURS[p] for p in line))
        for line in PIXELS
    ]
    mask = b"\x00" * (4 * SIZE)  # one bit a pixel, each row padded to 32 bits
    info = struct.pack("<IiiHHIIiiII", 40, SIZE, 2 * SIZE, 1, 32, 0, 0, 0, 0, 0, 0)
    image = info + b"".join(reversed(rows)) + mask
    header = struct.pack("<HHH", 0, 1, 1)
    entry = struct.pack("<BBBBHHII", SIZE, SIZE, 0, 0, 1, 32, len(image), ICO_HEADER_BYTES)
    return header + entry + image


async def _favicon() -> Response:
    return Response(
        icon(), media_type="image/x-icon", headers={"Cache-Control": "public, max-age=86400"}
    )


def install(app: FastAPI) -> None:
    app.add_api_route("/favicon.ico", _favicon, include_in_schema=False)
