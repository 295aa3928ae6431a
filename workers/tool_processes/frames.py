"""The messages between a worker and its tool processes: JSON, one frame each.

A frame is the length of its body (8 bytes, big-endian) and the body, a JSON object in ASCII
(a lone surrogate in a model's arguments travels as its escape). JSON, not pickle: a reply is
data, and reading it runs no code of the tool process's choosing.
"""

from __future__ import annotations

import json
import os
import select
import time
from typing import Any

HEADER = 8


class Closed(Exception):
    """The other end closed its pipe (it exited, or was killed) before a whole frame came."""


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, ensure_ascii=True).encode("ascii")
    return len(body).to_bytes(HEADER, "big") + body


def send(fd: int, message: dict[str, Any]) -> None:
    """Write one frame to ``fd`` whole (a pipe may take it in parts)."""
    data = memoryview(encode(message))
    while data:
        data = data[os.write(fd, data) :]


def receive(fd: int) -> dict[str, Any] | None:
    """Read one frame from ``fd``, waiting as long as it takes; None at the end of the pipe
    (before a frame began)."""
    head = _read(fd, HEADER)
    if head is None:
        return None
    body = _read(fd, int.from_bytes(head, "big"))
    if body is None:
        raise Closed("the pipe ended inside a frame")
    message: dict[str, Any] = json.loads(body)
    return message


def _read(fd: int, size: int) -> bytes | None:
    parts = bytearray()
    while len(parts) < size:
        chunk = os.read(fd, size - len(parts))
        if not chunk:
            return None
        parts += chunk
    return bytes(parts)


class Reader:
    """Reads frames from a non-blocking ``fd`` a little at a time, so that its caller can do
    other things between the parts: watch a deadline, count processes."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self._buffer = bytearray()

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for something to read (or the end of the pipe)."""
        return bool(self._poll.poll(max(0, int(seconds * 1000 + 0.999))))

    def take(self) -> dict[str, Any] | None:
        """Read what there is; the frame, once it is whole (None before that). Raises
        :class:`Closed` at the end of the pipe."""
        while True:
            try:
                chunk = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                return self._frame()
            if not chunk:
                raise Closed("the pipe ended")
            self._buffer += chunk
            if len(chunk) < 1 << 20:
                return self._frame()

    def _frame(self) -> dict[str, Any] | None:
        if len(self._buffer) < HEADER:
            return None
        size = int.from_bytes(self._buffer[:HEADER], "big")
        if len(self._buffer) < HEADER + size:
            return None
        body = bytes(self._buffer[HEADER : HEADER + size])
        del self._buffer[: HEADER + size]
        message: dict[str, Any] = json.loads(body)
        return message

    def until(self, deadline: float) -> dict[str, Any]:
        """The next frame, read by ``deadline`` (``time.monotonic()``); raises TimeoutError."""
        while (frame := self.take()) is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self.wait(left):
                raise TimeoutError
        return frame
