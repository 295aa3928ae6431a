"""Real MCP servers for the tests, built with the official SDK: one tool set (``toolset``),
served over stdio (``python -m tests.fakes.mcp_servers.stdio_server``) or Streamable HTTP
(``python -m tests.fakes.mcp_servers.http_server --port N``). Each records its starts and every
call it receives, with the call's ``_meta``, in the directory ``MCP_FAKE_DIR`` names, so
tests in another process can count them (``Record``)."""
