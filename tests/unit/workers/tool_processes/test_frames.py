"""Frames between a worker and its tool processes, over a real pipe: whole however the pipe
splits them, an end of the pipe told apart from a frame still coming."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import pytest

from workers.tool_processes import frames


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read, write = os.pipe()
    os.set_blocking(read, False)
    yield read, write
    for fd in (read, write):
        with contextlib.suppress(OSError):  # a test closed it already
            os.close(fd)


def test_a_frame_larger_than_the_pipe_arrives_whole(pipe: tuple[int, int]) -> None:
    read, write = pipe
    message = {"result": "x" * 1_000_000, "text": "é \ud800"}  # a lone surrogate travels too
    sender = threading.Thread(target=frames.send, args=(write, message))
    sender.start()
    assert frames.Reader(read).until(time.monotonic() + 30) == message
    sender.join()


def test_frames_come_one_at_a_time(pipe: tuple[int, int]) -> None:
    read, write = pipe
    os.write(write, frames.encode({"n": 1}) + frames.encode({"n": 2})[:5])
    reader = frames.Reader(read)
    assert reader.take() == {"n": 1}
    assert reader.take() is None  # the second is not whole yet
    os.write(write, frames.encode({"n": 2})[5:])
    assert reader.take() == {"n": 2}


def test_the_end_of_the_pipe_is_not_a_frame(pipe: tuple[int, int]) -> None:
    read, write = pipe
    os.write(write, frames.encode({"n": 1})[:3])
    os.close(write)
    with pytest.raises(frames.Closed):
        frames.Reader(read).until(time.monotonic() + 30)


def test_no_frame_by_the_deadline_is_a_timeout(pipe: tuple[int, int]) -> None:
    read, _ = pipe
    with pytest.raises(TimeoutError):
        frames.Reader(read).until(time.monotonic() + 0.05)


def test_a_blocking_reader_reads_a_frame_and_then_the_end(pipe: tuple[int, int]) -> None:
    read, write = pipe
    os.set_blocking(read, True)
    frames.send(write, {"ready": 1})
    os.close(write)
    assert frames.receive(read) == {"ready": 1}
    assert frames.receive(read) is None
