"""Tool processes: isolated tool calls, each in a long-lived process that is killed, not
abandoned, at its limits (``pool``), the process's own loop (``serve``), and the frames
between them (``frames``)."""

from workers.tool_processes.pool import NotRun, Stopped, call

__all__ = ["NotRun", "Stopped", "call"]
