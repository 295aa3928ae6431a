"""Agents and tools: how they are defined and found (``registry``), and the built-in tools."""
