"""MCP servers as tools: their settings, a client session per server and process, their tools."""
