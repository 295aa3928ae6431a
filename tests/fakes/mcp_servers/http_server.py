"""The test tools over Streamable HTTP on loopback: ``python -m tests.fakes.mcp_servers.http_server
--port N`` serves ``http://127.0.0.1:N/mcp``; :class:`HttpServer` starts and stops it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

from tests.fakes.mcp_servers.toolset import build

ROOT = Path(__file__).resolve().parents[3]
START_TIMEOUT_SECONDS = 30.0


class HttpServer:
    """The HTTP test server as a child process on a free loopback port, recording to
    ``directory``; ``with HttpServer(...) as server: server.url``."""

    def __init__(self, directory: Path, port: int) -> None:
        self.directory = directory
        self.port = port
        self.url = f"http://127.0.0.1:{port}/mcp"
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> HttpServer:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        env = {**os.environ, "MCP_FAKE_DIR": str(self.directory)}
        log = (self.directory / "http.log").open("ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fakes.mcp_servers.http_server", "--port", str(self.port)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not self._listening():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the MCP test server did not start: see {log.name}")
            time.sleep(0.05)

    def _listening(self) -> bool:
        try:
            httpx.get(f"http://127.0.0.1:{self.port}/", timeout=1)
        except httpx.HTTPError:
            return False
        return True

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="fake-http")
    options = parser.parse_args()
    build(options.name).run("streamable-http", host="127.0.0.1", port=options.port)
