"""The test tools over stdio: ``python -m tests.fakes.mcp_servers.stdio_server [name]``."""

from __future__ import annotations

import sys

from tests.fakes.mcp_servers.toolset import build

if __name__ == "__main__":
    build(sys.argv[1] if len(sys.argv) > 1 else "fake-stdio").run("stdio")
