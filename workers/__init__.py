"""The worker side: the Celery app, the step runner, model providers and tool execution."""
